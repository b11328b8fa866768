"""The adapters an engine knows: names, what is loaded in memory, what sits in the serving slots.

Three tiers, each bounded, each least recently used first out::

    registered   name -> path                  every adapter loaded by name (until unloaded)
    in memory    name -> LoRAAdapter            at most ``max_cpu_loras``; a dropped one is read
                                                again from its path when a request names it
    in slots     slot -> LoRAAdapter            at most ``max_loras``: the adapters a step can mix

Requests hold their :class:`LoRAAdapter` object from arrival to finish (``acquire`` /
``release``), not its name. So unloading a name, or loading other weights under it in place,
changes what *new* requests get; requests already running finish on the weights they started
with, and those keep their slot until the last of them ends. An adapter in use is never dropped
from memory nor from a slot.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.config import ModelConfig
from tokenmill.errors import InvalidParameterError
from tokenmill.lora.adapter import LoRAAdapter, load_adapter
from tokenmill.lora.config import LoRAConfig
from tokenmill.lora.slots import LoRASlots

logger = logging.getLogger("tokenmill.lora")


class UnknownAdapterError(InvalidParameterError):
    """A request or call names an adapter that is not loaded."""


@dataclass(frozen=True)
class AdapterInfo:
    """What ``list`` reports of one registered adapter."""

    name: str
    path: str
    loaded: bool
    """Its weights are in memory now."""
    in_use: int
    """Unfinished requests using its current weights."""
    created: int
    """Unix time it was registered."""


class LoRAManager:
    """The registry and both caches of one engine's adapters (see the module docstring)."""

    def __init__(self, config: LoRAConfig, model_config: ModelConfig, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.config, self.model_config = config, model_config
        self.slots = LoRASlots(model_config, config.max_loras, config.max_lora_rank, dtype, device,
                               int8=config.lora_dtype == "int8")
        self._paths: dict[str, tuple[str, int]] = {}
        """name -> (path, unix time registered)."""
        self._memory: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._users: dict[int, set[str]] = {}
        """id(adapter) -> the holders (sequence ids) using it."""
        self._slot_order: list[int] = list(range(config.max_loras))
        """Slots, least recently used first."""
        self.num_loads = 0
        self.load_seconds = 0.0

    # ---- names ----------------------------------------------------------------------------------
    def load(self, name: str, path: str | Path, replace: bool = False) -> LoRAAdapter:
        """Read the adapter at ``path`` and register it as ``name`` (:meth:`read`, then :meth:`add`)."""
        self.check_name(name, replace)
        return self.add(self.read(name, path), replace)

    def check_name(self, name: str, replace: bool = False) -> None:
        """Whether ``name`` may be loaded: non-empty, no ':' (``base:adapter`` names a pair), and not
        already loaded unless ``replace``; InvalidParameterError otherwise."""
        if not name or ":" in name:
            raise InvalidParameterError(f"adapter name {name!r} must be non-empty and without ':'", param="lora_name")
        if name in self._paths and not replace:
            raise InvalidParameterError(f"adapter {name!r} is already loaded; unload it first or load it in place",
                                        param="lora_name")

    def read(self, name: str, path: str | Path) -> LoRAAdapter:
        """The adapter at ``path``, checked against the model and ``max_lora_rank``; not registered
        (the server reads in a worker thread, then registers on the engine thread)."""
        return self._read(name, str(path))

    def add(self, adapter: LoRAAdapter, replace: bool = False) -> LoRAAdapter:
        """Register ``adapter`` under its name. A name already loaded is refused unless ``replace``
        (vLLM's ``load_inplace``): then new requests get the new weights, running ones finish on the old."""
        self.check_name(adapter.name, replace)
        self._paths[adapter.name] = (adapter.path, int(time.time()))
        self._remember(adapter)
        return adapter

    def unload(self, name: str) -> int:
        """Forget ``name``: new requests can no longer use it. -> unfinished requests still using
        it (they finish on its weights; its slot is freed after them)."""
        if name not in self._paths:
            raise UnknownAdapterError(f"adapter {name!r} is not loaded", param="lora_name")
        del self._paths[name]
        adapter = self._memory.pop(name, None)
        return self.users(adapter) if adapter is not None else 0

    def get(self, name: str) -> LoRAAdapter:
        """The current weights of ``name`` (read again from disk if they were dropped from memory)."""
        if name not in self._paths:
            known = ", ".join(sorted(self._paths)) or "none"
            raise UnknownAdapterError(f"adapter {name!r} is not loaded (loaded: {known})", param="model")
        adapter = self._memory.get(name)
        if adapter is None:
            adapter = self._read(name, self._paths[name][0])
        self._remember(adapter)
        return adapter

    def __contains__(self, name: str) -> bool:
        return name in self._paths

    @property
    def num_registered(self) -> int:
        """Adapters registered by name (not ``__len__``: an empty manager must stay truthy)."""
        return len(self._paths)

    def list(self) -> list[AdapterInfo]:
        out = []
        for name, (path, created) in self._paths.items():
            adapter = self._memory.get(name)
            out.append(AdapterInfo(name, path, adapter is not None, self.users(adapter) if adapter else 0, created))
        return out

    def _read(self, name: str, path: str) -> LoRAAdapter:
        start = time.perf_counter()
        adapter = load_adapter(name, path, self.model_config)
        if adapter.rank > self.config.max_lora_rank:
            raise InvalidParameterError(f"adapter {name!r} has rank {adapter.rank}, above max_lora_rank "
                                        f"{self.config.max_lora_rank}", param="lora_path")
        seconds = time.perf_counter() - start
        self.num_loads += 1
        self.load_seconds += seconds
        logger.info("LoRA adapter %s: rank %d on %s, %.1f MiB, read in %.0f ms from %s", name, adapter.rank,
                    ", ".join(sorted(adapter.targets)), adapter.nbytes / 2**20, seconds * 1e3, path)
        return adapter

    def _remember(self, adapter: LoRAAdapter) -> None:
        self._memory[adapter.name] = adapter
        self._memory.move_to_end(adapter.name)
        idle = [n for n, a in self._memory.items() if not self.users(a) and a is not adapter]
        while len(self._memory) > self.config.cpu_capacity and idle:
            del self._memory[idle.pop(0)]

    # ---- requests -------------------------------------------------------------------------------
    def acquire(self, adapter: LoRAAdapter, holder: str) -> None:
        """``holder`` (a sequence id) starts using ``adapter``."""
        self._users.setdefault(id(adapter), set()).add(holder)

    def release(self, adapter: LoRAAdapter, holder: str) -> None:
        """``holder`` is done with ``adapter``; idempotent."""
        holders = self._users.get(id(adapter))
        if holders is not None:
            holders.discard(holder)
            if not holders:
                del self._users[id(adapter)]

    def users(self, adapter: LoRAAdapter) -> int:
        """How many holders use ``adapter`` now."""
        return len(self._users.get(id(adapter), ()))

    # ---- slots ----------------------------------------------------------------------------------
    def activate(self, adapters: list[LoRAAdapter]) -> dict[int, int]:
        """Make every adapter of a step resident -> id(adapter) -> its slot. Slots of adapters not
        in the step are reused, least recently used first. At most ``max_loras`` adapters (the
        scheduler admits no more)."""
        wanted = {id(a): a for a in adapters}
        if len(wanted) > self.slots.num_slots:
            raise RuntimeError(f"a step with {len(wanted)} adapters; max_loras is {self.slots.num_slots}")
        where = {id(a): s for s, a in enumerate(self.slots.adapters) if a is not None and id(a) in wanted}
        for key, adapter in wanted.items():
            if key not in where:
                free = [s for s in self._slot_order if s not in where.values()
                        and (self.slots.adapters[s] is None or id(self.slots.adapters[s]) not in wanted)]
                slot = next((s for s in free if self.slots.adapters[s] is None), free[0])
                self.slots.assign(slot, adapter)
                where[key] = slot
        for slot in where.values():  # most recently used last
            self._slot_order.remove(slot)
            self._slot_order.append(slot)
        return where
