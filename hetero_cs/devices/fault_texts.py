"""The texts by which CUDA, cuBLAS, cuDNN, XLA and TensorFlow's allocator report out of memory or a device fault.

Read from a TensorFlow error by :mod:`hetero_cs.devices.device_errors` (which of its rules applies is said there), and
from a script's last lines on standard error by the supervisor (``hetero-cs run``). No TensorFlow here.
"""

import re


def _compiled_forms(table) -> tuple[tuple[str, re.Pattern], ...]:
    """(name, compiled pattern) for each (name, pattern, flags) of ``table``."""
    return tuple((name, re.compile(pattern, flags)) for name, pattern, flags in table)


# (name, pattern) of each out-of-memory form an Internal/Unknown/InvalidArgument error may carry; the first match
# names the form. A ResourceExhaustedError is out of memory whatever its text.
OOM_FORMS: tuple[tuple[str, re.Pattern], ...] = _compiled_forms((
        ("emulated", r"Emulated out of memory: replica=\d+", 0),
        ("allocator", r"\bOOM when allocating tensor", 0),
        ("allocator", r"ran out of memory trying to allocate", re.IGNORECASE),
        ("xla", r"Out of memory while trying to allocate", re.IGNORECASE),
        ("host-to-device copy", r"Dst tensor is not initialized", 0),
        ("cublas", r"CUBLAS_STATUS_ALLOC_FAILED", 0),
        ("cudnn", r"CUDNN_STATUS_ALLOC_FAILED", 0),
        ("scratch", r"Failed to allocate (?:\S+ )?(?:scratch|workspace)", re.IGNORECASE),
        ("cuda", r"cudaErrorMemoryAllocation|CUDA_ERROR_OUT_OF_MEMORY|CUDA error: out of memory", 0),
        ("allocator", r"failed to allocate (?:device )?memory", re.IGNORECASE),
))

# (name, pattern) of each device-fault form: the hardware's faults only (an allow-list). A code that a program or a
# build causes - no kernel image for the card, an invalid PTX, an invalid value or configuration, too many resources
# for a launch, a misaligned address, a device in exclusive mode - is not among them. The first match names the form.
DEVICE_FAULT_FORMS: tuple[tuple[str, re.Pattern], ...] = _compiled_forms((
        ("ecc", r"uncorrectable ECC error|CUDA_ERROR_ECC_UNCORRECTABLE|cudaErrorECCUncorrectable", re.IGNORECASE),
        ("illegal address", r"illegal memory access|CUDA_ERROR_ILLEGAL_ADDRESS|cudaErrorIllegalAddress", 0),
        ("launch failure", r"unspecified launch failure|CUDA_ERROR_LAUNCH_FAILED|cudaErrorLaunchFailure", 0),
        ("hardware stack", r"CUDA_ERROR_HARDWARE_STACK_ERROR|cudaErrorHardwareStackError", 0),
        ("lost", r"GPU is lost|fallen off the bus", re.IGNORECASE),
        ("sync", r"GPU sync failed", 0),
        ("cublas", r"CUBLAS_STATUS_EXECUTION_FAILED", 0),
        ("cudnn", r"CUDNN_STATUS_EXECUTION_FAILED", 0),
))
# A device-side assert (an index out of range in a kernel) is the program's, and so is everything CUDA reports after
# it (its errors are sticky: a launch failure, an illegal address, a failed sync follow it).
PROGRAM_ASSERT = re.compile(r"device-side assert|CUDA_ERROR_ASSERT|cudaErrorAssert", re.IGNORECASE)
# The forms after which CUDA's context on that card is broken (sticky errors): every later op there fails, so neither
# a retry nor the other cards can go on in this process. An emulated fault is not sticky.
STICKY_FORMS = frozenset({"ecc", "illegal address", "launch failure", "hardware stack", "lost", "sync"})

STICKY_TEXT = re.compile("|".join([
    *(pattern.pattern for name, pattern in DEVICE_FAULT_FORMS if name in STICKY_FORMS), PROGRAM_ASSERT.pattern,
    r"CUDA_ERROR_(?:ILLEGAL_INSTRUCTION|MISALIGNED_ADDRESS)"]), re.IGNORECASE)
"""The text of a sticky CUDA error, the card's (:data:`STICKY_FORMS`) or the program's (a device-side assert, an
illegal instruction, a misaligned address): the text alone does not tell which."""
