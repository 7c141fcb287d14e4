"""Memory caps that a restarted multi-worker job starts from, after a replica ran out of memory (pure).

On several machines a step that runs out of memory cannot be retried in place (see
:mod:`hetero_cs.engine.multi_worker.oom`): the job restarts instead, with that replica's cap lowered. The caps travel
to the restarted workers as one line of text in the environment variable :data:`CAPS_ENV_VAR`, one entry per
replica of the cluster in task-index then local order, ``none`` for a replica without a cap::

    HETERO_CS_MAX_BATCH_SIZES=none,4,none

``hetero-cs launch --max-restarts N`` sets it when it relaunches a job after such an error; a user who restarts the
workers another way may set it by hand, or pass the same list as ``max_batch_sizes``. The strategy lowers the caps
it would otherwise use (``max_batch_sizes``, or the emulated devices' memory) to these, entry by entry.

This module is pure: it imports neither TensorFlow nor pynvml.
"""

import math
import re
from collections.abc import Sequence

from hetero_cs.errors import ConfigError
from hetero_cs.planning.memory_caps import MemoryRecoveryPolicy
from hetero_cs.planning.plan import check_range

CAPS_ENV_VAR = "HETERO_CS_MAX_BATCH_SIZES"
NO_CAP = "none"


def format_caps(caps: Sequence[int | None]) -> str:
    """The caps as :data:`CAPS_ENV_VAR`'s text: ``[None, 4]`` -> ``"none,4"``.

    Examples:
        >>> format_caps([None, 4, 0])
        'none,4,0'
    """
    return ",".join(NO_CAP if c is None else str(int(c)) for c in caps)


def parse_caps(text: str, num_replicas: int, *, source: str = CAPS_ENV_VAR) -> list[int | None]:
    """The caps :data:`CAPS_ENV_VAR` (or ``source``) holds: one integer >= 0 or ``none`` per replica.

    Raises:
        ConfigError: Not ``num_replicas`` comma-separated entries, or an entry that is neither an integer >= 0 nor
            ``none``; the message names ``source``, the text and the fix.

    Examples:
        >>> parse_caps("none, 4", 2)
        [None, 4]
    """
    caps = read_caps(text)
    if caps is None or len(caps) != num_replicas:
        raise ConfigError(
            f"{source}={text!r} must give one memory cap per replica of the cluster (num_replicas_in_sync="
            f"{num_replicas}), comma-separated, each an integer >= 0 (examples the card holds at once) or "
            f"'{NO_CAP}' (no cap), e.g. {format_caps([None] * max(num_replicas - 1, 0) + [4])!r}. hetero-cs launch "
            f"sets it when it relaunches a job after an out-of-memory error; unset it or fix it.")
    return caps


def read_caps(text: str) -> list[int | None] | None:
    """The caps :data:`CAPS_ENV_VAR`'s text holds, however many, or None when it is empty or not of that form.

    Examples:
        >>> read_caps("none,4"), read_caps("4,x")
        ([None, 4], None)
    """
    entries = [entry.strip().lower() for entry in str(text).split(",")] if str(text).strip() else []
    if not entries or not all(entry == NO_CAP or re.fullmatch(r"[0-9]+", entry) for entry in entries):
        return None
    return [None if entry == NO_CAP else int(entry) for entry in entries]


def lowest_caps(*cap_lists: Sequence[int | None] | None) -> list[int | None] | None:
    """The lowest cap of each replica over ``cap_lists`` (None lists and None entries: no cap); None when no list
    is given.

    Raises:
        ValueError: Lists of different lengths.

    Examples:
        >>> lowest_caps([None, 8], None, [6, 4])
        [6, 4]
    """
    given = [list(caps) for caps in cap_lists if caps is not None]
    if not given:
        return None
    if len({len(caps) for caps in given}) != 1:
        raise ValueError(f"cap lists of different lengths: {given}")
    return [min((int(c) for c in entries if c is not None), default=None) for entries in zip(*given)]


def lowered_caps(caps: Sequence[int | None] | None, num_replicas: int, replica_id: int, examples: int,
                 backoff_factor: float = MemoryRecoveryPolicy.backoff_factor) -> list[int | None]:
    """The caps for a restart after replica ``replica_id`` ran out of memory holding ``examples`` at once.

    That replica's cap becomes ``floor(examples * backoff_factor)`` (0.5, as
    :class:`hetero_cs.planning.memory_caps.MemoryRecoveryPolicy` lowers a cap on one machine; 0 when one example
    did not fit, and the card then takes no example), or stays lower if it was already; the others keep theirs.

    Raises:
        ConfigError: ``replica_id`` not an integer in ``[0, num_replicas)``, ``examples`` not an integer >= 1, or a
            backoff outside (0, 1).

    Examples:
        >>> lowered_caps(None, 3, 1, 9)
        [None, 4, None]
    """
    check_range("replica_id", replica_id, 0, num_replicas, integer=True, hint="one of the cluster's replicas")
    check_range("examples", examples, 1, integer=True, hint="a replica runs out of memory holding at least one example")
    check_range("backoff_factor", backoff_factor, 0, 1, low_open=True)
    lowered: list[int | None] = [None] * num_replicas
    lowered[int(replica_id)] = math.floor(int(examples) * backoff_factor)
    return lowest_caps(caps, lowered)
