"""`train`'s commands (`aiayn NAME`): options' flags and one call each; the library never imports them."""
