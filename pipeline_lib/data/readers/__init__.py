"""Source readers, one module per format; `registry.open_reader` picks the one for a file."""
