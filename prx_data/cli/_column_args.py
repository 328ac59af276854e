"""Command-line options shared by ``prx_data.cli.caption`` and ``prx_data.cli.classify``."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

from prx_data.cli.reporting import add_report_args, run_job
from prx_data.columns.backends import GenerationConfig, ModelJobConfig
from prx_data.core.flags import add_flags, from_args


def column_job_parser(
    prog: str, description: str, config: type[ModelJobConfig], *, max_tokens: int
) -> argparse.ArgumentParser:
    """The job's flags (``config``'s fields), sampling, per-backend options and run options."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    add_flags(p, config)
    s = p.add_argument_group("sampling")
    add_flags(s, GenerationConfig)
    p.set_defaults(max_tokens=max_tokens)
    o = p.add_argument_group("openai backend")
    o.add_argument(
        "--base-url",
        default="http://127.0.0.1:8000/v1",
        help="endpoint base URL, up to /v1 (default: %(default)s)",
    )
    o.add_argument(
        "--api-key-env",
        default="OPENAI_API_KEY",
        help="environment variable holding the API key, if any (default: %(default)s)",
    )
    o.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="requests in flight per replica (default: %(default)s)",
    )
    o.add_argument(
        "--timeout", type=float, default=120.0, help="seconds per request (default: %(default)s)"
    )
    o.add_argument(
        "--max-retries",
        type=int,
        default=5,
        help="retries on 429/5xx/timeouts with exponential backoff (default: %(default)s)",
    )
    s.add_argument(
        "--chat-template-kwargs",
        default=None,
        help="JSON object of chat-template variables, e.g. '{\"enable_thinking\": false}' for "
        "Qwen3 models (openai: sent as chat_template_kwargs, which vllm serve and SGLang accept)",
    )
    v = p.add_argument_group("vllm backend")
    v.add_argument(
        "--engine-kwargs",
        default=None,
        help='JSON object passed to vllm.LLM, e.g. \'{"max_model_len": 8192, '
        '"gpu_memory_utilization": 0.9, "tensor_parallel_size": 1}\'',
    )
    t = p.add_argument_group("transformers backend")
    t.add_argument(
        "--device",
        default="auto",
        help="cpu, cuda or cuda:N; cuda gives each replica one GPU (default: auto = cuda if visible)",
    )
    t.add_argument(
        "--dtype", default="auto", help="torch dtype such as bfloat16 (default: %(default)s)"
    )
    t.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow checkpoints that ship their own modelling code",
    )
    add_report_args(p)
    return p


def _json_object(value: str | None, flag: str) -> dict:
    try:
        obj = json.loads(value) if value else {}
    except json.JSONDecodeError as e:
        raise SystemExit(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise SystemExit(f"{flag} must be a JSON object")
    return obj


def backend_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Only the options of the chosen backend (others are left at their defaults)."""
    template = _json_object(args.chat_template_kwargs, "--chat-template-kwargs")
    if args.backend == "openai":
        opts: dict[str, Any] = {
            "base_url": args.base_url,
            "api_key_env": args.api_key_env,
            "concurrency": args.concurrency,
            "timeout": args.timeout,
            "max_retries": args.max_retries,
        }
        if template:
            opts["extra_body"] = {"chat_template_kwargs": template}
        return opts
    if args.backend == "vllm":
        return {
            "engine_kwargs": _json_object(args.engine_kwargs, "--engine-kwargs"),
            "chat_template_kwargs": template,
        }
    if args.backend == "transformers":
        return {
            "device": args.device,
            "dtype": args.dtype,
            "trust_remote_code": args.trust_remote_code,
            "chat_template_kwargs": template,
        }
    return {}


def run_column_job(args: argparse.Namespace, config: type[ModelJobConfig], run: Callable) -> int:
    """The shared tail of the caption/classify CLIs: build the config, run, report.

    Configuration and backend errors print one line and exit 2.
    """
    return run_job(
        args,
        config,
        run,
        generation=from_args(GenerationConfig, args),
        backend_options=backend_options_from_args(args) if args.backend else {},
    )
