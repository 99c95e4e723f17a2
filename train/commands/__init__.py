"""`train`'s commands (`aiayn NAME`, `python -m train.commands.NAME`): each a module of flags generated from
options dataclasses and one call into the library, which never imports them (docs/design.md#layout)."""
