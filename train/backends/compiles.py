"""Programs JAX compiles in this process and their seconds, from `jax.monitoring` (jax imported in `listen`)."""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass(frozen=True)
class Compiles:
    """Programs compiled (cache reads included), their seconds, and the cache reads among them."""

    programs: int = 0
    seconds: float = 0.0
    cache_hits: int = 0

    def __sub__(self, other: Compiles) -> Compiles:
        return Compiles(self.programs - other.programs, self.seconds - other.seconds,
                        self.cache_hits - other.cache_hits)

    def to_dict(self) -> dict[str, Any]:
        """results.json's fields."""
        return {"compiled_programs": self.programs, "compile_seconds": self.seconds,
                "compile_cache_hits": self.cache_hits}

    def text(self) -> str:
        hits = f", {self.cache_hits} from the compile cache" if self.cache_hits else ""
        return f"{self.programs} program(s) compiled in {self.seconds:.1f} s{hits}"


_lock = threading.Lock()  # JAX may compile from several threads
_totals = Compiles()
_listening = False


def _count(event: str, seconds: float = 0.0, **_: Any) -> None:
    """JAX's listener of both kinds: a program compiled (a duration event, its seconds) or read from the cache."""
    global _totals
    compiled, hit = event == COMPILE_EVENT, event == CACHE_HIT_EVENT
    if compiled or hit:
        with _lock:
            _totals = Compiles(_totals.programs + compiled, _totals.seconds + seconds, _totals.cache_hits + hit)


def listen() -> None:
    """Count JAX's compilations from now on (once per process; later calls do nothing)."""
    global _listening
    with _lock:
        if _listening:
            return
        _listening = True
    from jax import monitoring

    monitoring.register_event_duration_secs_listener(_count)
    monitoring.register_event_listener(_count)


def totals() -> Compiles:
    """The counts since `listen` (a run reports the difference of two: `later - earlier`)."""
    return _totals
