"""`parity`'s commands (`aiayn NAME`, named in train/commands): the library never imports them."""
