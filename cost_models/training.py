"""The training configuration a plan is made for."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cost_models.codecs import COMPRESS_CHOICES, check_codec
from planner.errors import InvalidInputError

Schedule = Literal["1f1b", "gpipe"]
Optimizer = Literal["sgd", "adam", "adamw"]
ComputeDtype = Literal["float32", "bfloat16", "float16"]

SCHEDULES: tuple[str, ...] = ("1f1b", "gpipe")
OPTIMIZERS: tuple[str, ...] = ("sgd", "adam", "adamw")
DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
# Element-wise kernels per parameter tensor of one optimizer step as torch runs it on one device
# (``torch.optim``'s per-tensor loop): Adam steps its counter, updates both moments (lerp_, mul_,
# addcmul_), forms the denominator (sqrt, div, add_), reads the step count back and updates the
# weight (addcdiv_); AdamW decays the weight first (one mul_ more); plain SGD is one add_.
OPTIM_OPS_PER_TENSOR = {"adam": 9, "adamw": 10, "sgd": 1}
ADAM_LIKE: frozenset[str] = frozenset({"adam", "adamw"})  # two moments per parameter


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainingConfig:
    """One optimizer step = ``global_batch`` samples in microbatches of ``microbatch_size``.

    ``mixed_precision`` keeps fp32 master weights and Adam moments beside
    low-precision compute weights (the 16 bytes/parameter of mixed-precision Adam).
    """

    global_batch: int
    microbatch_size: int
    schedule: Schedule = "1f1b"
    optimizer: Optimizer = "adam"
    dtype: ComputeDtype = "float32"
    mixed_precision: bool = False
    compress: str = "none"  # boundary codecs: cost_models.codecs.COMPRESS_CHOICES

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.microbatch_size < 1:
            raise InvalidInputError("batch sizes", expected="global_batch >= 1 and microbatch_size >= 1",
                                    found=f"{self.global_batch} and {self.microbatch_size}")
        if self.global_batch % self.microbatch_size:
            raise InvalidInputError(
                "global_batch", expected=f"a multiple of microbatch_size {self.microbatch_size}",
                found=str(self.global_batch), fix="choose a microbatch size that divides the global batch")
        if self.schedule not in SCHEDULES:
            raise InvalidInputError("schedule", expected=" or ".join(SCHEDULES), found=repr(self.schedule))
        if self.optimizer not in OPTIMIZERS:
            raise InvalidInputError("optimizer", expected=" or ".join(OPTIMIZERS), found=repr(self.optimizer))
        if self.dtype not in DTYPES:
            raise InvalidInputError("dtype", expected=" or ".join(DTYPES), found=repr(self.dtype))
        check_codec(self.compress, allowed=COMPRESS_CHOICES)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // self.microbatch_size

    def to_dict(self) -> dict:
        return {"global_batch": self.global_batch, "microbatch_size": self.microbatch_size,
                "schedule": self.schedule, "optimizer": self.optimizer, "dtype": self.dtype,
                "mixed_precision": self.mixed_precision, "compress": self.compress}

    @classmethod
    def from_dict(cls, d: dict) -> "TrainingConfig":
        return cls(**d)
