"""The memory store: embedders and (later) the indexed store of remembered items."""
