"""``copy.deepcopy`` for objects that hold locks (pure: standard library only).

A lock cannot be copied (``TypeError: cannot pickle '_thread.lock' object``) and must not be shared: two copies
guarding their own state with one lock would block each other. The copy gets a new, unlocked lock of the same kind
in its place, and a new, empty ``threading.local`` in place of one; everything else is deep-copied as
``copy.deepcopy`` would. Stock ``tf.distribute`` strategies copy
this way (``Strategy.__deepcopy__`` deep-copies the strategy's attributes, its ``extended`` object included).
"""

import copy
import threading
from typing import Any

# What a copy gets in place of a lock, or of per-thread state (set while a thread runs fit): a new, empty one.
_FRESH = ((type(threading.RLock()), lambda _: threading.RLock()), (type(threading.Lock()), lambda _: threading.Lock()),
          (threading.local, lambda local: type(local)()))


def deepcopy_attributes(source: Any, result: Any, memo: dict) -> Any:
    """Sets a deep copy of each of ``source``'s attributes on ``result``, a new lock for a lock; returns ``result``.

    The caller puts ``result`` in ``memo`` first, so references back to ``source`` lead to ``result``.
    """
    for name, value in source.__dict__.items():
        fresh = next((make for kind, make in _FRESH if isinstance(value, kind)), None)
        setattr(result, name, copy.deepcopy(value, memo) if fresh is None else fresh(value))
    return result


class DeepcopiedWithNewLocks:
    """Mixin: ``copy.deepcopy`` copies every attribute and gives the copy new locks (see the module docstring)."""

    def __deepcopy__(self, memo: dict) -> Any:
        result = memo[id(self)] = type(self).__new__(type(self))
        return deepcopy_attributes(self, result, memo)
