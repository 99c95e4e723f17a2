"""`parity`'s commands and `aiayn` (`cli`), the dispatcher of every command: flags and one call each
into the library, which never imports them (docs/design.md#layout)."""
