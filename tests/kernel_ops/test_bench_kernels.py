"""The benchmark's report plumbing (no timing is asserted anywhere)."""

from __future__ import annotations

from pipeline.benchmarks.kernels import BEGIN, END, markdown, write_docs

REPORT = dict(
    machine=dict(
        device="cpu",
        dtype="float32",
        torch="x",
        threads=1,
        processor="p",
        cpus=2,
        load_avg_1min=0.5,
        gpu=None,
    ),
    copy_bytes_per_s=1e10,
    results=[
        dict(
            op="kv_copy",
            label="small",
            shape=dict(layers=1, n=4, host_src=False),
            impl="torch",
            seconds=1e-3,
            bytes=2**20,
            bytes_per_s=2**20 / 1e-3,
            of_copy_bw=0.1,
        )
    ],
)


def test_markdown_table_rows():
    text = markdown(REPORT)
    assert "10.00 GB/s" in text
    assert "| kv_copy (small) | layers=1, n=4 | torch | 1.000 ms | 1.00 MiB |" in text


def test_write_docs_replaces_only_the_marked_section(tmp_path):
    doc = tmp_path / "k.md"
    doc.write_text(f"intro\n{BEGIN}\nold table\n{END}\noutro\n")
    assert write_docs(doc, "new table")
    assert doc.read_text() == f"intro\n{BEGIN}\nnew table\n{END}\noutro\n"
    plain = tmp_path / "plain.md"
    plain.write_text("no markers")
    assert not write_docs(plain, "t") and plain.read_text() == "no markers"
    assert not write_docs(tmp_path / "missing.md", "t")
