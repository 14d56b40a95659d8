"""LoRA adapters in the fake replica: ``max_lora`` slots with least-recently-used swapping, and
vLLM's ``vllm:lora_requests_info`` series.

vLLM with ``--enable-lora`` serves the base model and the adapters it knows of (``--lora-modules``,
or loaded at run time through ``/v1/load_lora_adapter`` or a LoRA resolver plugin, which loads an
adapter by name on its first request); at most ``--max-loras`` of them sit in GPU slots at once,
and a request for another one swaps it in, evicting the least recently used. A model name it
cannot resolve is answered 404 (``NotFoundError``, "The model `x` does not exist.").

The fake does the same: ``adapters`` are known and loaded at start (the first ``max_lora`` of
them in slots, the rest swapped in when asked for). With ``on_demand`` (the default, as with a
resolver) any other name is loaded by name on its first request; without it, such a name is a
404. Two simplifications: an adapter swaps in at once (no load time, no waiting queue, so
``waiting_lora_adapters`` stays empty), and an adapter used by a request in flight can be
evicted. ``running_lora_adapters`` lists the adapters in slots, which is what a router reads it as
(vLLM lists the adapters of running requests, which are in slots).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

LORA_INFO = "vllm:lora_requests_info"


class LoraSlots:
    """The adapters one replica knows of and holds, most recently used last."""

    def __init__(
        self,
        max_lora: int,
        adapters: Iterable[str] = (),
        *,
        on_demand: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        names = [a for a in dict.fromkeys(adapters) if a]
        if max_lora < 0:
            raise ValueError("max_lora must not be negative")
        if names and max_lora == 0:
            raise ValueError("LoRA adapters need max_lora >= 1")
        self.max_lora = max_lora
        self.on_demand = on_demand
        self.known: set[str] = set(names)
        self._loaded: OrderedDict[str, None] = OrderedDict((a, None) for a in names[:max_lora])
        self._clock = clock
        self.updated_at = clock()
        self.loads = 0
        self.evictions = 0

    @property
    def enabled(self) -> bool:
        """Whether LoRA is on (``max_lora`` above zero)."""
        return self.max_lora > 0

    @property
    def loaded(self) -> tuple[str, ...]:
        """The adapters in slots, least recently used first."""
        return tuple(self._loaded)

    def can_serve(self, name: str) -> bool:
        """Whether a request naming adapter ``name`` would be served (loaded, known or loadable).
        A name with a comma is never loadable: the metric lists adapters comma-joined."""
        if not self.enabled or not name:
            return False
        return name in self.known or (self.on_demand and "," not in name and name.isprintable())

    def use(self, name: str) -> bool:
        """Serve a request for adapter ``name``: mark it used, swapping it in (and the least
        recently used one out) if needed. False when it cannot be served (a 404)."""
        if not self.can_serve(name):
            return False
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return True
        self.known.add(name)
        if len(self._loaded) >= self.max_lora:
            self._loaded.popitem(last=False)
            self.evictions += 1
        self._loaded[name] = None
        self.loads += 1
        self.updated_at = self._clock()
        return True

    def exposition(self) -> str:
        """The ``vllm:lora_requests_info`` family in Prometheus text format ("" when LoRA is off);
        no ``model_name`` label, and the value is the time of the last change, as vLLM's."""
        if not self.enabled:
            return ""
        # Sorted, so the series changes only when the set does (and then its time with it).
        running = ",".join(sorted(self._loaded)).replace("\\", "\\\\").replace('"', '\\"')
        return (
            f"# HELP {LORA_INFO} Running stats on lora requests.\n"
            f"# TYPE {LORA_INFO} gauge\n"
            f'{LORA_INFO}{{max_lora="{self.max_lora}",running_lora_adapters="{running}",'
            f'waiting_lora_adapters=""}} {self.updated_at}\n'
        )
