"""The catalog of emulated accelerators: published figures of real devices, each with its source (pure).

``DeviceSpec`` holds one device's peak fp32/TF32/fp16/bf16 throughput, memory size and bandwidth and PCIe link;
``CATALOG`` maps names (data centre: A10, T4, P100, V100, A100, H100, H100SXM, H200, L4, L40S; workstation: RTXA6000,
RTX3090, RTX4090; the legacy GTX1080Ti, P40, K80, RTX2080Ti; CPU) to specs, read from ``catalog.json`` beside this
module (each device's figures and their source), and ``get_device_spec`` looks one up.
The emulator and the what-if (:func:`hetero_cs.devices.workload.emulated_step_time_s`) turn these figures into step
times; calibration and the monitor never read them. This module imports neither TensorFlow nor pynvml.
"""

import dataclasses
import json
import math
import numbers
import pathlib
import re
import types
from collections.abc import Mapping
from typing import Any

from hetero_cs.errors import ConfigError, UnknownEmulatedDeviceError, UnsupportedPrecisionError

TIME_SCALE_ENV_VAR = "HETERO_CS_EMULATION_TIME_SCALE"
"""Environment variable fixing ``Emulator.time_scale`` (a float in (0, MAX_TIME_SCALE]); an explicit argument wins
over it."""

TARGET_MAKESPAN_ENV_VAR = "HETERO_CS_EMULATION_TARGET_MAKESPAN_MS"
"""Environment variable setting the emulated even-split step the strategy aims for, in milliseconds, in
[MIN_TARGET_MAKESPAN_MS, MAX_EMULATED_MAKESPAN_S * 1000]; default 100."""

MAX_TIME_SCALE = 1000.0
"""Largest ``time_scale``: at 1000 the emulated 0.5 ms launch overhead alone makes every step take 0.5 s."""

MAX_EMULATED_MAKESPAN_S = 5.0
"""Longest emulated even-split step, seconds: a target above it, or a fixed time scale that stretches a model's step
beyond it, is refused (calibration alone runs about a hundred steps; at 5 s each that is minutes already)."""

MIN_TARGET_MAKESPAN_MS = 1.0
"""Shortest emulated even-split step to aim for, milliseconds: below it the host's own work sets the step time."""

DEFAULT_COMPUTE_EFFICIENCY = 0.5
"""Fraction of the peak FLOP/s (of the unit the dtype runs on) that a step's convolutions and matmuls sustain, one
figure for every card: cuDNN and cuBLAS run large layers at 60-90 % of peak and small or early ones far below, so half
overall. The layers' memory traffic is counted apart (ACTIVATION_PASSES), so this is not the whole step's share."""

ACTIVATION_PASSES = 10.0
"""Times a training step moves each layer's output through device memory, at the datasheet bandwidth: counted, a
layer's output is written once and read about 1.3 times forward (batch normalisation reads its input twice), and
backward its gradient is written once and read about 1.7 times (a convolution reads it for the input and again for
the weight gradient) while the saved output is read again: about 8 passes, which streaming kernels run at about 80 %
of the datasheet bandwidth, so 8 / 0.8 = 10. This is the part that tensor cores do not speed up: with it, TF32 on an
H200 runs ResNet-50 about 2x faster than fp32, not the 7.4x of their peaks (measured: 2.1x)."""

DEFAULT_LAUNCH_OVERHEAD_S = 5e-4
"""Fixed per-step cost (op dispatch, synchronisation, the step's own small kernels), an assumption: ~50 kernels x
~10 us."""

LAYER_OVERHEAD_S = 6e-5
"""GPU time each layer costs per training step whatever its slice, an assumption: its forward kernel, its backward
kernels (input and weight gradients) and its optimizer update, about 4 kernels at about 15 us each (launch, ramp-up
and tail of a kernel that fills the device). ResNet-50's 176 layers: 10.6 ms, beside the 13.7 ms an H200 takes for
one example (fp32; see docs/emulation.md)."""

# Usable bandwidth per lane and direction after line encoding, in bytes/s (PCI-SIG base specifications):
# gen1 2.5 GT/s and gen2 5 GT/s use 8b/10b; gen3 8 GT/s, gen4 16 GT/s, gen5 32 GT/s use 128b/130b.
# Real DMA throughput is a further ~10-20 % lower (TLP headers); the emulation uses these link rates.
PCIE_BYTES_PER_S_PER_LANE: Mapping[int, float] = types.MappingProxyType(
    {1: 0.250e9, 2: 0.500e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9})


def _is_real(value: Any) -> bool:
    """A real number (Python or numpy), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    """An integer (Python or numpy), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _float_or(text: str, failed: Any) -> Any:
    """``float(text)``, or ``failed`` when the text is not a number (the caller refuses it with its own message)."""
    try:
        return float(text)
    except ValueError:
        return failed


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """Published figures of one device.

    Attributes:
        name: Catalog key, e.g. "A10"; with a memory override, the key and the size as given ("T4@48MB").
        fp32_tflops: Peak dense fp32 throughput (non-tensor-core), in 1e12 FLOP/s; > 0.
        tf32_tflops: Peak dense TF32 tensor-core throughput (no sparsity), 1e12 FLOP/s, which TensorFlow runs float32
            matmuls and convolutions at by default from compute capability 8.0 (Ampere) on; None where the card has
            no TF32 (T4, P100, V100 and older, the CPU).
        fp16_tflops: Peak dense fp16 throughput (tensor cores where the device has them, no sparsity), 1e12 FLOP/s.
        memory_bytes: Device memory, in bytes (1 GB = 1e9 bytes as in the datasheets).
        memory_bandwidth_bytes_per_s: Peak device-memory bandwidth, in bytes/s.
        pcie_generation: PCIe generation of the host link (1-5); None for the host CPU (no link: same memory).
        pcie_lanes: Lanes of the host link (1-32); None for the host CPU.
        source: Where the figures come from (datasheet name and URL, or a stated assumption).
        bf16_tflops: Peak dense bfloat16 throughput in 1e12 FLOP/s, or None when the device has no bfloat16
            arithmetic (NVIDIA GPUs before compute capability 8.0: P100 6.0, V100 7.0, T4 7.5).
    """

    name: str
    fp32_tflops: float
    fp16_tflops: float
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    pcie_generation: int | None
    pcie_lanes: int | None
    source: str
    bf16_tflops: float | None = None
    tf32_tflops: float | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("DeviceSpec.name is empty; give the catalog key, e.g. name='A10'.")
        for field in ("fp32_tflops", "fp16_tflops", "memory_bandwidth_bytes_per_s", "bf16_tflops", "tf32_tflops"):
            value = getattr(self, field)
            optional = "None (the card has no such arithmetic) or " if field in ("bf16_tflops", "tf32_tflops") else ""
            if not (value is None and optional) and not (_is_real(value) and math.isfinite(value) and value > 0):
                raise ConfigError(f"DeviceSpec {self.name!r}: {field}={value!r} must be {optional}a finite number > 0.")
        if not (isinstance(self.memory_bytes, int) and self.memory_bytes > 0):
            raise ConfigError(f"DeviceSpec {self.name!r}: memory_bytes={self.memory_bytes!r} must be an int > 0.")
        if (self.pcie_generation is None) != (self.pcie_lanes is None):
            raise ConfigError(f"DeviceSpec {self.name!r}: pcie_generation={self.pcie_generation!r} and pcie_lanes="
                              f"{self.pcie_lanes!r} must both be set (a PCIe device) or both be None (the host CPU).")
        if self.pcie_generation is not None and self.pcie_generation not in PCIE_BYTES_PER_S_PER_LANE:
            raise ConfigError(f"DeviceSpec {self.name!r}: pcie_generation={self.pcie_generation!r} is not one of "
                              f"{sorted(PCIE_BYTES_PER_S_PER_LANE)}.")
        if self.pcie_lanes is not None and not (isinstance(self.pcie_lanes, int) and 1 <= self.pcie_lanes <= 32):
            raise ConfigError(f"DeviceSpec {self.name!r}: pcie_lanes={self.pcie_lanes!r} must be an int in [1, 32].")
        if not self.source:
            raise ConfigError(f"DeviceSpec {self.name!r}: source is empty; cite the datasheet or the assumption.")

    def peak_tflops(self, compute_dtype: str = "float32", *, tf32: bool = True) -> float:
        """Peak throughput for a compute dtype, in 1e12 FLOP/s: the rate TensorFlow runs that dtype at on this card.

        Args:
            compute_dtype: The dtype the layers compute in: "float32" (policy "float32"), "float16" (policy
                "mixed_float16") or "bfloat16" (policy "mixed_bfloat16"); a policy name is accepted too.
            tf32: Whether float32 matmuls and convolutions run on TF32 tensor cores where the card has them
                (TensorFlow's default, ``tf.config.experimental.tensor_float_32_execution_enabled()``); a card
                without TF32 runs float32 at ``fp32_tflops`` either way.

        Raises:
            UnsupportedPrecisionError: If the device has no bfloat16 arithmetic (``bf16_tflops`` is None).
            ConfigError: If ``compute_dtype`` is none of these.

        Examples:
            >>> get_device_spec("T4").peak_tflops("float16"), get_device_spec("T4").peak_tflops("float32")
            (65.0, 8.1)
            >>> a10 = get_device_spec("A10")
            >>> a10.peak_tflops("float32"), a10.peak_tflops("float32", tf32=False)  # TF32 tensor cores, CUDA cores
            (62.5, 31.2)
        """
        _, tflops = self._rate(compute_dtype, tf32)
        if tflops is None:
            raise UnsupportedPrecisionError(
                f"Emulated device {self.name} has no bfloat16 arithmetic (compute_dtype='bfloat16'): bfloat16 needs an "
                f"NVIDIA GPU of compute capability 8.0 or newer (A10, A100, H100, L4, RTX 3090). Use the policy "
                f"'mixed_float16' on it, or leave it out.", device=self.name, compute_dtype="bfloat16")
        return tflops

    def rate_name(self, compute_dtype: str = "float32", *, tf32: bool = True) -> str:
        """Which of the card's rates ``peak_tflops`` gives: "fp32", "tf32", "fp16" or "bf16"."""
        return self._rate(compute_dtype, tf32)[0]

    def _rate(self, compute_dtype: str, tf32: bool) -> tuple[str, float | None]:
        float32 = ("tf32", self.tf32_tflops) if tf32 and self.tf32_tflops is not None else ("fp32", self.fp32_tflops)
        return {"float16": ("fp16", self.fp16_tflops), "bfloat16": ("bf16", self.bf16_tflops)}.get(
            compute_dtype_of(compute_dtype), float32)

    @property
    def pcie_bandwidth_bytes_per_s(self) -> float:
        """Usable host-link bandwidth per direction, in bytes/s; ``math.inf`` for the host CPU (no copy needed).

        Per lane: gen3 0.985e9, gen4 1.969e9, gen5 3.938e9 bytes/s (line rate after 128b/130b encoding), so a
        gen4 x16 link gives 31.5e9 bytes/s each way.
        """
        lanes = self.pcie_lanes  # set together with pcie_generation (__post_init__), None for the host CPU
        return math.inf if lanes is None else PCIE_BYTES_PER_S_PER_LANE[self.pcie_generation] * lanes




_COMPUTE_DTYPES = {"float32": "float32", "mixed_float16": "float16", "float16": "float16",
                   "mixed_bfloat16": "bfloat16", "bfloat16": "bfloat16"}


def compute_dtype_of(policy: str) -> str:
    """The compute dtype of a Keras dtype policy name: "float32", "float16" or "bfloat16".

    Args:
        policy: A policy name ("float32", "mixed_float16", "mixed_bfloat16") or a compute dtype.

    Raises:
        ConfigError: For any other name (float64 policies are not emulated).
    """
    if (dtype := _COMPUTE_DTYPES.get(policy) if isinstance(policy, str) else None) is None:
        raise ConfigError(f"Unknown dtype policy or compute dtype {policy!r} for emulation; use one of "
                          f"{', '.join(sorted(_COMPUTE_DTYPES))}.")
    return dtype


MEMORY_OVERRIDE_SEPARATOR = "@"
"""Separates a catalog name from a memory override in an emulated device name: ``"T4@48MB"``."""
LINK_OVERRIDE_SEPARATOR = "~"
"""Separates a catalog name (and its memory override) from a host-link override: ``"P100~x1"``."""
_LINK_PATTERN = re.compile(r"^\s*(?:gen([1-5]))?x([0-9]+)\s*$", re.IGNORECASE | re.ASCII)

_MEMORY_UNITS: Mapping[str, int] = types.MappingProxyType({"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
                                                          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})
_MEMORY_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-z]+)\s*$", re.IGNORECASE | re.ASCII)


def parse_memory_bytes(text: str) -> int:
    """Parses a memory size such as ``"48MB"``, ``"1.5 GiB"`` or ``"512kb"`` into bytes.

    Units (case-insensitive): B; KB, MB, GB, TB (powers of 1000, as datasheets use); KiB, MiB, GiB, TiB (powers of
    1024).

    Raises:
        ConfigError: If ``text`` is not a number followed by one of these units, or is under 1 byte.

    Examples:
        >>> parse_memory_bytes("48MB"), parse_memory_bytes("1GiB")
        (48000000, 1073741824)
    """
    match = _MEMORY_PATTERN.match(text) if isinstance(text, str) else None
    unit = match and _MEMORY_UNITS.get(match.group(2).lower())
    value = int(float(match.group(1)) * unit) if unit else 0
    if value < 1:
        raise ConfigError(f"A memory size is a number and a unit (B, KB, MB, GB, TB, KiB, MiB, GiB), "
                          f"at least 1 byte, e.g. '48MB' or '1.5GiB'. Received: {text!r}.")
    return value


# The figures are NVIDIA's datasheets and architecture whitepapers (PCIe form factors unless the name says SXM), one
# entry per device in catalog.json beside this module, each with its "source". fp16, bf16 and TF32 are the dense
# tensor-core figures (datasheets mark those "with sparsity" with an asterisk: dense is half) with fp32 accumulation,
# as mixed-precision training runs; P100 has no tensor cores, so its fp16 is the packed-half rate. GeForce cards run
# fp16/bf16 tensor math with fp32 accumulation at half the rate of fp16 accumulation; mixed-precision training
# accumulates in fp32, so that is their figure. Of the legacy cards that labs reuse beside newer ones, Pascal
# consumer/inference dies (GP102) run fp16 arithmetic at 1/64 of fp32 and Kepler (GK210) has none, so their fp16
# figure is the real (slow) rate.
def _read_catalog() -> dict[str, DeviceSpec]:
    """The devices of catalog.json, in its order; an entry's "memory" is a size as :func:`parse_memory_bytes` reads
    it (1 GB = 1e9 bytes, as in the datasheets), its other keys are DeviceSpec's fields."""
    entries = json.loads(pathlib.Path(__file__).with_name("catalog.json").read_text(encoding="utf-8"))
    return {name: DeviceSpec(name=name, memory_bytes=parse_memory_bytes(entry.pop("memory")), **entry)
            for name, entry in entries.items()}


CATALOG: Mapping[str, DeviceSpec] = types.MappingProxyType(_read_catalog())


def _nearest_name(text: str) -> str:
    """" Did you mean 'RTX4090'?" for a catalog key written with spaces, dashes or underscores ("RTX 4090",
    "h100-sxm"), else ""."""
    folded = {re.sub(r"[\s_-]", "", key).lower(): key for key in CATALOG}
    key = folded.get(re.sub(r"[\s_-]", "", str(text)).lower())
    return f" Did you mean {key!r}?" if key else ""


def get_device_spec(name: str) -> DeviceSpec:
    """Looks up a catalog device, case-insensitively; ``NAME@SIZE`` overrides its memory, ``NAME~LINK`` its PCIe link.

    Args:
        name: A catalog key such as "A10", "t4" or "cpu", optionally followed by ``@`` and a memory size
            (``"T4@48MB"``: a T4 with 48e6 bytes of memory, e.g. to emulate a small card or another process
            holding most of it; see :func:`parse_memory_bytes` for the units), then optionally by ``~`` and a host
            link, ``xLANES`` or ``genGxLANES`` (``"P100~x1"``: a P100 on a one-lane riser; ``"T4@8GB~gen2x4"``),
            lanes 1-32 and generation 1-5 (the catalog's generation when left out).

    Returns:
        The device's DeviceSpec (with ``memory_bytes``, ``pcie_generation`` and ``pcie_lanes`` replaced when the name
        carries overrides).

    Raises:
        UnknownEmulatedDeviceError: If the catalog key is not in the catalog (the message lists the known names).
        ConfigError: If the memory override is not a size, or the link override is not a link or names one for the
            host CPU (which has none).

    Examples:
        >>> get_device_spec("t4").fp32_tflops, get_device_spec("T4@48MB").memory_bytes
        (8.1, 48000000)
        >>> spec = get_device_spec("P100~x1")
        >>> spec.name, spec.pcie_generation, spec.pcie_lanes
        ('P100~x1', 3, 1)
    """
    head, link_separator, link_text = name.partition(LINK_OVERRIDE_SEPARATOR) if isinstance(name, str) else ("",) * 3
    key_text, separator, memory_text = head.partition(MEMORY_OVERRIDE_SEPARATOR)
    spec = next((spec for key, spec in CATALOG.items() if key.lower() == key_text.strip().lower()), None)
    if spec is None:
        raise UnknownEmulatedDeviceError(f"Unknown emulated device name={name!r}.{_nearest_name(key_text)} Known "
                                         f"devices: {', '.join(CATALOG)}. Use one of these names (case does not "
                                         f"matter).")
    if separator:  # "T4@" (no size) is refused by the parser, not read as the catalog size
        # The name keeps the override: banners show it, a re-lookup by name (an Emulator passed on as names) keeps
        # the memory, and profile cache keys tell the two memories apart.
        spec = dataclasses.replace(spec, memory_bytes=parse_memory_bytes(memory_text),
                                   name=f"{spec.name}{MEMORY_OVERRIDE_SEPARATOR}{memory_text.strip()}")
    return _with_link(spec, link_text, name) if link_separator else spec


def _with_link(spec: DeviceSpec, link_text: str, name: str) -> DeviceSpec:
    """``spec`` on the host link ``link_text`` (``x1``, ``gen2x4``), its name keeping the override."""
    match = _LINK_PATTERN.match(link_text)
    if spec.pcie_generation is None:
        raise ConfigError(f"{name!r}: the host CPU has no PCIe link to override; drop the '~{link_text}'.")
    lanes = int(match.group(2)) if match else 0
    if match is None or not 1 <= lanes <= 32:
        raise ConfigError(
            f"{name!r}: a link override comes last, 'NAME[@MEMORY]~xLANES' or '~genGxLANES', with 1-32 lanes and "
            f"generation 1-5, e.g. 'P100~x1' (a one-lane riser) or 'T4@8GB~gen2x4'. Received: {link_text!r}.")
    return dataclasses.replace(spec, pcie_generation=int(match.group(1)) if match.group(1) else spec.pcie_generation,
                               pcie_lanes=lanes, name=f"{spec.name}{LINK_OVERRIDE_SEPARATOR}{link_text.strip()}")


def emulated_identity(name) -> tuple | None:
    """(catalog device, memory bytes, PCIe generation, PCIe lanes) of an emulated name, so "T4@48MB", "t4@48mb" and
    "T4@48000000B" match, and a profile calibrated with a memory or link override (its caps, its fixed cost) matches
    only the same one; None for None (not emulated). A name the catalog does not know is compared as written."""
    if name is None:
        return None
    try:
        spec = get_device_spec(name)
    except (UnknownEmulatedDeviceError, ConfigError):
        return (str(name).upper(), None)
    return (spec.name.partition(LINK_OVERRIDE_SEPARATOR)[0].partition(MEMORY_OVERRIDE_SEPARATOR)[0].upper(),
            spec.memory_bytes, spec.pcie_generation, spec.pcie_lanes)
