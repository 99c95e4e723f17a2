"""`parity`'s commands and `aiayn` (`cli`), which names every command; the library never imports them."""
