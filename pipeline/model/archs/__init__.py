"""One module per served architecture; see ``pipeline.model.registry``."""
