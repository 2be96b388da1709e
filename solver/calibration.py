"""Statistical calibration of the memory cost model against measured peaks (as in CAPTURE).

The analytic model (``solver.costs``) predicts a stage's peak as the sum of six components,
``StageCost.breakdown()``: weights, grads, optimizer, activations, buffers, transient. A
:class:`Calibration` multiplies each component by a scale and adds a per-GPU constant:

    calibrated peak = sum_c ceil(scale_c * bytes_c) + constant_bytes

Each scaled component is rounded up on its own (exactly: the float scale is converted to a
fraction first), so a calibration with every scale 1 and constant 0 gives the analytic peak to the
byte. ``solver.costs`` applies the same scales to its per-layer coefficients (rounding up per
layer), so its stage totals may exceed :meth:`Calibration.apply` of the analytic breakdown by less
than one byte per layer per component.

:func:`fit_calibration` fits the few parameters that a handful of real runs can identify (see
:data:`PARAMETERS`) by least squares on the relative error; :func:`leave_one_out` refits without
each configuration in turn and reports the held-out errors. Writing and loading the JSON file are
:meth:`Calibration.to_dict`, :func:`write_calibration` and :func:`load_calibration`.

No torch here: the planner loads calibration files.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from solver.errors import InputError, quote
from solver.files.jsonfile import read_json
from solver.files.output_file import check_output, write_json_file

COMPONENTS = ("weights", "grads", "optimizer", "activations", "buffers", "transient")
"""The keys of ``StageCost.breakdown()``; a calibration scales each one."""

PARAMETERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("states", ("weights", "grads", "optimizer")),
    ("activations", ("activations",)),
    ("buffers", ("buffers", "transient")),
)
"""The scales :func:`fit_calibration` fits, and the components each one multiplies.

Few parameters, because a calibration run has a few configurations of one model: weights,
gradients and optimizer state all grow with the same per-stage parameter count, so no set of runs
can tell their scales apart (one "states" scale); activations vary with the schedule and the
micro-batch count (their own scale); boundary buffers and the loss-head transient are small and
vary together with the stage position (one scale). Then the constant bytes per GPU. Parameters
are taken in this order, constant last, as long as each one adds a direction the samples can
resolve; the rest keep the analytic value (scale 1, constant 0) and are listed in the fit's
``meta["fixed"]``."""

FORMAT = "memplan-calibration"
VERSION = 1
SCALE_RANGE = (0.01, 100.0)
"""Smallest and largest scale of a component. The analytic components count bytes a run
allocates (parameters x bytes per parameter, the tensors profiling saw saved), so a scale says
how far the real run is from those counts: on real runs the model is within a median 0.4% (max
4.8%), and was within 33% before its runtime terms (docs/cost-model.md, "Calibrated model"). A
component at under 1% or over 100x of its count is no longer a correction but another run (the
wrong model, precision or runtime, or a unit error), and a scale of 0 would drop memory the GPU
holds (every scale 0 once gave a peak of 0 B that "fits")."""
MIN_SCALE, MAX_SCALE = SCALE_RANGE
MAX_CONSTANT_BYTES = 2**40
"""Largest constant per GPU, either sign: 1 TiB, 4x the largest GPU memory of today (288 GB).
The constant stands for what the model does not see on every GPU (the CUDA context, NCCL and
cuBLAS buffers, fragmentation: a few GiB). A negative one is further bounded by the plan it is
applied to: it may take away only from a stage's activations, buffers and transients, never from
its model states (``check_stage_peaks``)."""
_RANK_TOLERANCE = 1e-9
"""Singular values below this (relative to the largest, columns normalised) count as zero."""


@dataclass(frozen=True)
class Calibration:
    """Scales per breakdown component and a constant per GPU, applied to every stage's peak.

    Hashable and comparable on ``scales`` and ``constant_bytes`` only (``meta`` describes where
    the numbers came from), so a ``TrainingConfig`` holding one stays hashable.
    """

    scales: dict[str, float] = field(default_factory=dict)
    """Multiplier per ``StageCost.breakdown()`` key; a missing key means 1.0. Stored complete."""
    constant_bytes: int = 0
    """Bytes added to every stage's peak, per GPU (may be negative). Fitted to real runs, it
    stands for memory the analytic model does not see, so a CLI given a calibration whose
    constant is not 0 uses it in place of the default reserve (``solver.reserve.default_reserve``;
    ``--reserve`` still applies when given)."""
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    """Provenance: model, configurations, fit residuals, leave-one-out errors, torch version,
    date (free-form, JSON-serialisable)."""
    source: str | None = field(default=None, compare=False, repr=False)
    """Where it was read from, for messages (the file; not written)."""

    def __post_init__(self) -> None:
        if not isinstance(self.scales, Mapping):
            raise InputError(f"calibration scales: {quote(self.scales)} must be an object")
        unknown = sorted(map(str, set(self.scales) - set(COMPONENTS)))
        if unknown:
            raise InputError(
                "calibration scales: unknown component(s) "
                f"{', '.join(quote(key, bare=True) for key in unknown[:3])}; "
                f"valid: {', '.join(COMPONENTS)}"
            )
        complete = {}
        for name in COMPONENTS:
            value = self.scales.get(name, 1.0)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or not MIN_SCALE <= value <= MAX_SCALE
            ):
                raise InputError(
                    f"calibration scales.{name}: {quote(value)} must be a finite number in "
                    f"[{MIN_SCALE:g}, {MAX_SCALE:g}] (the real run's bytes over the model's for "
                    "that component)"
                )
            complete[name] = float(value)
        object.__setattr__(self, "scales", complete)
        constant = self.constant_bytes
        if (
            isinstance(constant, bool)
            or not isinstance(constant, int)
            or abs(constant) > MAX_CONSTANT_BYTES
        ):
            raise InputError(
                f"calibration constant_bytes: {quote(constant)} must be an integer number of "
                "bytes in -2^40..2^40 (1 TiB either way, more than any GPU holds)"
            )

    def __hash__(self) -> int:
        return hash((tuple(self.scales[name] for name in COMPONENTS), self.constant_bytes))

    def scale(self, component: str) -> float:
        """The multiplier of one ``StageCost.breakdown()`` component."""
        return self.scales[component]

    def apply(self, breakdown: Mapping[str, int]) -> int:
        """Calibrated peak bytes: sum_c ceil(scale_c * bytes_c) + constant_bytes.

        ``breakdown`` is ``StageCost.breakdown()`` (keys from :data:`COMPONENTS`; a missing key
        counts 0 bytes). Each product is rounded up on its own, exactly.
        """
        unknown = sorted(set(breakdown) - set(COMPONENTS))
        if unknown:
            raise InputError(f"breakdown: unknown component(s) {', '.join(unknown)}")
        total = sum(
            math.ceil(Fraction(self.scales[name]) * int(breakdown.get(name, 0)))
            for name in COMPONENTS
        )
        return total + self.constant_bytes

    def to_dict(self) -> dict[str, Any]:
        """The JSON document :func:`load_calibration` reads."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "scales": dict(self.scales),
            "constant_bytes": self.constant_bytes,
            "meta": self.meta,
        }

    def summary(self) -> str:
        """One line: 'weights x1.02, ..., constant +12345 B'."""
        scales = ", ".join(f"{name} x{self.scales[name]:.4g}" for name in COMPONENTS)
        return f"{scales}; constant {self.constant_bytes:+d} B per GPU"


def write_calibration(
    path: str | Path, calibration: Calibration, *, force: bool = False, flag: str = ""
) -> None:
    """Write ``calibration.to_dict()`` as JSON by the one writing path
    (``solver.files.output_file``:
    atomic for a regular file); refuse to replace an existing regular file unless ``force``.
    ``flag`` ('--out') starts the messages."""
    destination = check_output(path, flag=flag)
    if destination.replaces is not None and not force:
        raise InputError(
            f"{destination.label}: already exists; pass --force to overwrite it or choose --out"
        )
    write_json_file(path, calibration.to_dict(), flag=flag)


def load_calibration(path: str | Path) -> Calibration:
    """Read a calibration file; every problem is a one-line ``InputError`` naming the field."""
    fix = "write one with python -m profiling.calibrate"
    document = read_json(path, kind="calibration", fix=fix)
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise InputError(f'{path}: not a calibration file (expected "format": "{FORMAT}"); {fix}')
    if document.get("version") != VERSION:
        raise InputError(
            f"{path}: version {quote(document.get('version'))} is not supported (expected "
            f"{VERSION})"
        )
    unknown = sorted(set(document) - {"format", "version", "scales", "constant_bytes", "meta"})
    if unknown:
        raise InputError(
            f"{path}: unknown field(s) "
            f"{', '.join(quote(key, bare=True) for key in unknown[:3])}; remove them"
        )
    missing = [key for key in ("scales", "constant_bytes") if key not in document]
    if missing:
        raise InputError(
            f"{path}: missing field(s) {', '.join(missing)} (scales: {{component: number}}, "
            "constant_bytes: integer)"
        )
    scales = document["scales"]
    if not isinstance(scales, dict):
        raise InputError(f"{path}: scales must be an object mapping component to number")
    meta = document.get("meta", {})
    if not isinstance(meta, dict):
        raise InputError(f"{path}: meta must be an object")
    constant = document["constant_bytes"]
    if isinstance(constant, float) and constant.is_integer() and abs(constant) <= 2**53:
        constant = int(constant)  # 1e6 is fine; 1.5 is not
    try:
        return Calibration(scales=scales, constant_bytes=constant, meta=meta, source=str(path))
    except InputError as error:
        raise InputError(f"{path}: {error}") from None


# -- fitting -----------------------------------------------------------------------------------


class Sample(NamedTuple):
    """One rank of one real run."""

    predicted: Mapping[str, int]
    """The analytic ``StageCost.breakdown()`` of the rank's stage."""
    measured_bytes: float
    """The measured peak of the rank."""
    group: str
    """The configuration it belongs to (leave-one-out holds out whole groups)."""


def fit_calibration(
    samples: Iterable[Sample | tuple[Mapping[str, int], float, str]],
    *,
    fit_constant: bool = True,
) -> Calibration:
    """Least-squares calibration from (predicted breakdown, measured peak, group) samples.

    Minimises sum_i ((calibrated_i - measured_i) / measured_i)^2, the squared relative error
    (every rank counts alike whatever its size), over the scales of :data:`PARAMETERS` (at least
    :data:`MIN_SCALE`) and the constant (any sign, rounded to whole bytes). The lower bound: the
    exact optimum over every subset of scales pinned at it (at most 2^3 small solves with
    ``np.linalg.lstsq``). A fit outside :data:`SCALE_RANGE` or :data:`MAX_CONSTANT_BYTES` is an
    InputError: the runs do not describe the model.
    Parameters the samples cannot identify keep their analytic values. ``meta`` records the fitted
    and fixed parameters and each sample's residual in percent.
    """
    rows = [Sample(*sample) for sample in samples]
    if not rows:
        raise InputError("calibration fit: no samples; run at least one configuration")
    for row in rows:
        if not (math.isfinite(row.measured_bytes) and row.measured_bytes > 0):
            raise InputError(
                f"calibration fit: measured peak {row.measured_bytes!r} of group {row.group!r} "
                "must be a finite number of bytes > 0"
            )
    columns, names = _design(rows, fit_constant)
    measured = np.array([row.measured_bytes for row in rows], dtype=float)
    chosen = _identifiable(columns, measured)
    values = _bounded_lstsq(columns[:, chosen], measured, [names[i] for i in chosen])
    fitted = dict(zip([names[i] for i in chosen], values, strict=True))
    scales = {
        component: float(fitted.get(name, 1.0))
        for name, components in PARAMETERS
        for component in components
    }
    try:
        calibration = Calibration(scales=scales, constant_bytes=round(fitted.get("constant", 0.0)))
    except InputError as error:
        raise InputError(
            f"calibration fit: {str(error).removeprefix('calibration ')}; the measured peaks do "
            "not follow the model's (another model, precision or runtime?)"
        ) from None
    residuals = [
        100.0 * (calibration.apply(row.predicted) - row.measured_bytes) / row.measured_bytes
        for row in rows
    ]
    calibration.meta.update(
        fitted=[names[i] for i in chosen],
        fixed=[name for i, name in enumerate(names) if i not in chosen],
        objective="relative least squares",
        groups=sorted({row.group for row in rows}),
        residuals_pct=[round(value, 4) for value in residuals],
    )
    return calibration


class HeldOut(NamedTuple):
    """One configuration predicted by a fit on the others."""

    calibration: Calibration
    """The fit without the held-out configuration."""
    errors_pct: list[float]
    """Its ranks' errors, 100 (calibrated - measured) / measured, in sample order."""


def leave_one_out(
    samples: Iterable[Sample | tuple[Mapping[str, int], float, str]],
    *,
    fit_constant: bool = True,
) -> dict[str, HeldOut]:
    """For each group: fit on the other groups and score the held-out group's ranks.

    Errors are negative when the calibration under-predicts (the sign convention of
    ``profiling.run.RankReport.error_pct``). Keys in first-seen group order.
    """
    rows = [Sample(*sample) for sample in samples]
    groups = list(dict.fromkeys(row.group for row in rows))
    if len(groups) < 2:
        raise InputError(
            f"leave-one-out needs at least 2 configurations (groups), got {len(groups)}"
        )
    results = {}
    for held_out in groups:
        calibration = fit_calibration(
            [row for row in rows if row.group != held_out], fit_constant=fit_constant
        )
        results[held_out] = HeldOut(
            calibration,
            [
                100.0 * (calibration.apply(row.predicted) - row.measured_bytes) / row.measured_bytes
                for row in rows
                if row.group == held_out
            ],
        )
    return results


def _design(rows: Sequence[Sample], fit_constant: bool) -> tuple[np.ndarray, list[str]]:
    """Columns: bytes of each parameter's components per sample, then ones for the constant."""
    for row in rows:
        unknown = sorted(set(row.predicted) - set(COMPONENTS))
        if unknown:
            raise InputError(f"calibration fit: unknown component(s) {', '.join(unknown)}")
    names = [name for name, _ in PARAMETERS]
    columns = [
        [float(sum(int(row.predicted.get(c, 0)) for c in components)) for row in rows]
        for _, components in PARAMETERS
    ]
    if fit_constant:
        names.append("constant")
        columns.append([1.0] * len(rows))
    return np.array(columns, dtype=float).T, names


def _weighted(columns: np.ndarray, measured: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Divide every row by its measured peak (relative error) and every column by its norm."""
    weighted = columns / measured[:, None]
    norms = np.linalg.norm(weighted, axis=0)
    norms[norms == 0] = 1.0
    return weighted / norms, norms


def _identifiable(columns: np.ndarray, measured: np.ndarray) -> list[int]:
    """Columns, in order, that each raise the rank of the (weighted, normalised) design."""
    weighted, _ = _weighted(columns, measured)
    chosen: list[int] = []
    for index in range(columns.shape[1]):
        trial = weighted[:, [*chosen, index]]
        if trial.shape[1] > trial.shape[0] or not np.any(trial[:, -1]):
            continue  # more unknowns than samples, or a component that is always 0
        singular = np.linalg.svd(trial, compute_uv=False)
        if singular[-1] > _RANK_TOLERANCE * singular[0]:
            chosen.append(index)
    return chosen


def _bounded_lstsq(columns: np.ndarray, measured: np.ndarray, names: list[str]) -> np.ndarray:
    """argmin || (X theta - y) / y ||, scales >= MIN_SCALE, by trying every subset of scales
    pinned at MIN_SCALE (the active sets of the lower bounds)."""
    if not names:
        return np.zeros(0)
    weighted, norms = _weighted(columns, measured)
    target = np.ones(len(measured))  # y / y
    floor = MIN_SCALE * norms  # the lower bound of each column's weighted coefficient
    bounded = [i for i, name in enumerate(names) if name != "constant"]
    best: tuple[float, np.ndarray] | None = None
    for size in range(len(bounded) + 1):
        for pinned in itertools.combinations(bounded, size):
            free = [i for i in range(len(names)) if i not in pinned]
            theta = np.zeros(len(names))
            theta[list(pinned)] = floor[list(pinned)]
            if free:
                rest = target - weighted[:, list(pinned)] @ theta[list(pinned)]
                solution, *_ = np.linalg.lstsq(weighted[:, free], rest, rcond=None)
                theta[free] = solution
            if any(theta[i] < floor[i] * (1 - 1e-12) for i in bounded):
                continue
            residual = float(np.sum((weighted @ theta - target) ** 2))
            if best is None or residual < best[0] - 1e-15:
                best = (residual, theta)
        if best is not None and size == 0:
            break  # the unconstrained optimum is feasible: it is the answer
    assert best is not None, "pinning every scale at its lower bound is always feasible"
    values = best[1] / norms
    values[bounded] = np.maximum(values[bounded], MIN_SCALE)  # rounding at the bound
    return values
