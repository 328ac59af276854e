"""Captioning and caption classification: backends, prompts, output checks, labels.

The Ray jobs live in ``prx_data.pipelines.caption`` and ``prx_data.pipelines.classify``; the
CLIs are ``python -m prx_data.caption`` and ``python -m prx_data.classify``.
"""

from prx_data.columns.backends import (
    BACKENDS,
    Backend,
    BackendSpec,
    BackendUnavailable,
    Generation,
    GenerationConfig,
    OpenAIBackend,
    Request,
    TransformersBackend,
    VLLMBackend,
    make_spec,
)
from prx_data.columns.checks import STATUSES, LoopLimits, check
from prx_data.columns.labels import LABELS, UNKNOWN, RuleFilter, parse_label
from prx_data.columns.prompts import load_classify_prompt, load_prompt

__all__ = [
    "BACKENDS",
    "LABELS",
    "STATUSES",
    "UNKNOWN",
    "Backend",
    "BackendSpec",
    "BackendUnavailable",
    "Generation",
    "GenerationConfig",
    "LoopLimits",
    "OpenAIBackend",
    "Request",
    "RuleFilter",
    "TransformersBackend",
    "VLLMBackend",
    "check",
    "load_classify_prompt",
    "load_prompt",
    "make_spec",
    "parse_label",
]
