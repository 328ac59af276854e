"""Generation backends behind one small interface: prepare -> generate -> decode.

A :class:`Backend` turns a list of :class:`Request` (a prompt, optionally an
encoded image) into a list of :class:`Generation` (text, why it stopped, or
an error). The Ray pipelines build one backend per actor from a picklable
:class:`BackendSpec`, so the same job runs on any of:

* ``vllm`` - the vLLM offline engine (``vllm.LLM.chat``), one replica per
  GPU through a Ray actor pool; the throughput path for large runs.
* ``openai`` - any OpenAI-compatible ``/v1/chat/completions`` endpoint
  (``vllm serve``, SGLang, a hosted API), with a concurrency limit and
  retries with exponential backoff on 429, 5xx, connection errors and
  timeouts.
* ``transformers`` - Hugging Face ``generate`` with ``AutoProcessor`` +
  ``AutoModelForImageTextToText`` (or ``AutoTokenizer`` +
  ``AutoModelForCausalLM`` for text-only jobs); it also runs on CPU.

A JSON schema in :class:`GenerationConfig` (``json_schema``, structured
attributes) becomes vLLM guided decoding or the endpoint's
``response_format``, or an xgrammar token mask in the transformers
backend (:func:`compile_schema`, also on the CPU); the job validates every
output either way (:mod:`prx_data.columns.structured`).

Heavy imports (torch, transformers, vllm) happen inside the backends, so
importing this module is cheap.
"""

from __future__ import annotations

import base64
import importlib.util
import inspect
import json
import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

from prx_data.core.errors import PrxDataError, UsageError
from prx_data.core.flags import REQUIRED, comma_list, flag
from prx_data.core.runtime import RunOptions, run_field

log = logging.getLogger(__name__)


class BackendUnavailable(PrxDataError, RuntimeError):
    """The backend's library (or hardware) is not available on this machine."""


class BackendFailing(PrxDataError, RuntimeError):
    """The backend failed on every row of several batches in a row: a set-up fault, not bad rows."""


@dataclass(frozen=True)
class GenerationConfig:
    """Sampling settings shared by every backend (greedy by default: reproducible)."""

    max_tokens: int = flag(
        512,
        "--max-tokens",
        type=int,
        help="generation limit in tokens; hitting it mid-sentence flags the row (default: %(default)s)",
    )
    temperature: float = flag(
        0.0, "--temperature", type=float, help="0 = greedy, reproducible (default: %(default)s)"
    )
    top_p: float = flag(
        1.0, "--top-p", type=float, help="nucleus sampling mass (default: %(default)s)"
    )
    #: Ignored by the ``openai`` backend unless the server accepts it.
    repetition_penalty: float = flag(
        1.0,
        "--repetition-penalty",
        type=float,
        help="values like 1.05 reduce loops with Qwen-VL models; 1.0 disables (default: %(default)s)",
    )
    seed: int | None = flag(None, "--seed", type=int, help="sampling seed (with --temperature > 0)")
    #: A JSON schema (as JSON text, :func:`prx_data.columns.structured.canonical`) the
    #: output must follow: vLLM guided decoding, the endpoint's ``response_format``, or
    #: xgrammar's token mask in the transformers backend; the job validates every output.
    json_schema: str | None = None

    def __post_init__(self) -> None:
        if self.json_schema is not None:
            try:
                ok = isinstance(json.loads(self.json_schema), dict)
            except json.JSONDecodeError:
                ok = False
            if not ok:
                raise UsageError("json_schema must be a JSON object, as text")
        if self.max_tokens < 1:
            raise UsageError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise UsageError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UsageError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Request:
    """One prompt; ``image`` is encoded bytes (JPEG/PNG), already within the pixel budget."""

    prompt: str
    image: bytes | None = None


@dataclass
class Generation:
    """What came back. ``finish_reason`` is ``"stop"``, ``"length"`` or ``None`` (unknown)."""

    text: str | None
    finish_reason: str | None = None
    error: str | None = None


class Backend(ABC):
    """prepare(requests) -> generate(prepared) -> decode(raw) -> list[Generation].

    Subclasses take ``(model, generation, **options)``; ``options`` are the
    keyword arguments of their ``__init__``, so a :class:`BackendSpec` can be
    validated before any actor starts.
    """

    name: ClassVar[str]

    def __init__(self, model: str, generation: GenerationConfig | None = None):
        self.model = model
        self.generation = generation or GenerationConfig()

    @classmethod  # noqa: B027 - optional hook
    def check_available(cls) -> None:
        """Raise :class:`BackendUnavailable` when this backend cannot run here."""

    @abstractmethod
    def prepare(self, requests: Sequence[Request]) -> Any:
        """Turn requests into the backend's native inputs."""

    @abstractmethod
    def generate(self, prepared: Any) -> Any:
        """Run the model (or the endpoint) on prepared inputs."""

    @abstractmethod
    def decode(self, raw: Any) -> list[Generation]:
        """Native outputs -> one :class:`Generation` per request, in order."""

    def __call__(self, requests: Sequence[Request]) -> list[Generation]:
        """Run a batch; if it fails as a whole, run its requests one by one.

        One bad input (an aspect ratio the processor rejects, a prompt over
        the context length) then costs one ``error`` row, not the batch. A
        backend failing on every row is caught by :class:`FailureGuard`.
        """
        if not requests:
            return []
        try:
            out = self.decode(self.generate(self.prepare(requests)))
        except Exception as e:
            if len(requests) == 1:
                return [Generation(None, None, f"{type(e).__name__}: {e}"[:300])]
            log.warning(
                "%s batch of %d failed (%s); retrying one by one", self.name, len(requests), e
            )
            return [g for r in requests for g in self([r])]
        if len(out) != len(requests):  # decode() broke its contract: a bug in the backend class
            raise RuntimeError(
                f"{self.name} backend returned {len(out)} results for {len(requests)} requests"
            )
        return out

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (threads, sessions, engines)."""


class FailureGuard:
    """Stops a job whose backend fails on every row, instead of marking the whole table.

    Per-row errors are normal (a corrupt image, a request that ran out of
    retries); ``max_failed_batches`` consecutive batches with no success
    mean the model or endpoint is down, and the job should stop (it is
    resumable) rather than store ``error`` everywhere.
    """

    def __init__(self, max_failed_batches: int = 5):
        self.max_failed_batches = max_failed_batches
        self.failed_batches = 0

    def update(self, gens: Sequence[Generation]) -> None:
        if not gens:
            return
        if all(g.error is not None for g in gens):
            self.failed_batches += 1
            if self.failed_batches >= self.max_failed_batches:
                raise BackendFailing(
                    f"the backend failed on every row of {self.failed_batches} batches in a row; "
                    f"last error: {gens[-1].error}. Fix the backend and rerun: finished rows are kept."
                )
        else:
            self.failed_batches = 0


def image_mime(data: bytes) -> str:
    """MIME type of encoded image bytes, for data URLs."""
    if data[:3] == b"\xff\xd8\xff":
        return "image/jpeg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "image/png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    raise ValueError("image bytes are not JPEG, PNG, WebP or GIF")


def data_url(data: bytes) -> str:
    """``data:<mime>;base64,...``: how chat APIs take inline images."""
    return f"data:{image_mime(data)};base64,{base64.b64encode(data).decode('ascii')}"


def chat_messages(request: Request) -> list[dict]:
    """OpenAI-format chat for one request (image first, then the instruction)."""
    if request.image is None:
        return [{"role": "user", "content": request.prompt}]
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": data_url(request.image)}},
                {"type": "text", "text": request.prompt},
            ],
        }
    ]


def response_format(json_schema: str, name: str = "attributes") -> dict:
    """OpenAI's structured-output request field for a schema (``vllm serve`` and SGLang take it)."""
    return {
        "type": "json_schema",
        "json_schema": {"name": name, "schema": json.loads(json_schema), "strict": True},
    }


# --- transformers -----------------------------------------------------------


class TransformersBackend(Backend):
    """Hugging Face ``generate``, batched with left padding; runs on CPU or GPU.

    Vision mode loads ``AutoProcessor`` + ``AutoModelForImageTextToText``
    (every request must carry an image); text mode loads ``AutoTokenizer`` +
    ``AutoModelForCausalLM``. The prompt goes through the checkpoint's chat
    template when it has one.
    """

    name = "transformers"

    def __init__(
        self,
        model: str,
        generation: GenerationConfig | None = None,
        *,
        text_only: bool = False,
        device: str = "auto",
        dtype: str = "auto",
        trust_remote_code: bool = False,
        chat_template_kwargs: dict | None = None,
    ):
        super().__init__(model, generation)
        import torch
        import transformers as tf

        self._torch = torch
        self.text_only = text_only
        #: Extra template variables, e.g. ``{"enable_thinking": False}`` for Qwen3.
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device
        torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
        kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
        if text_only:
            self.processor = tf.AutoTokenizer.from_pretrained(model, **kwargs)
            self.tokenizer = self.processor
            auto = tf.AutoModelForCausalLM
        else:
            # use_fast=True is what transformers now picks for VLM image processors
            # anyway; left unset, it says so at every load (a notice nobody can act on).
            self.processor = tf.AutoProcessor.from_pretrained(model, use_fast=True, **kwargs)
            self.tokenizer = self.processor.tokenizer
            auto = getattr(tf, "AutoModelForImageTextToText", None) or tf.AutoModelForVision2Seq
        # Decoder-only generation needs left padding so new tokens line up.
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # transformers 4.56 renamed ``torch_dtype`` to ``dtype``.
        major, minor = (int(x) for x in tf.__version__.split(".")[:2])
        kwargs["dtype" if (major, minor) >= (4, 56) else "torch_dtype"] = torch_dtype
        self.net = auto.from_pretrained(model, **kwargs).to(device).eval()
        eos = self.net.generation_config.eos_token_id
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if self.tokenizer.eos_token_id is not None:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_ids = set(eos)
        self._grammar = None
        if self.generation.json_schema is not None:
            self._grammar = compile_schema(
                self.tokenizer, self.net, self.generation.json_schema, sorted(self.eos_ids)
            )

    def _prompt_text(self, request: Request) -> str:
        if request.image is None:
            content: Any = request.prompt
        else:
            content = [{"type": "image"}, {"type": "text", "text": request.prompt}]
        template = getattr(self.processor, "chat_template", None) or getattr(
            self.tokenizer, "chat_template", None
        )
        if not template:
            return request.prompt
        return self.processor.apply_chat_template(
            [{"role": "user", "content": content}],
            add_generation_prompt=True,
            tokenize=False,
            **self.chat_template_kwargs,
        )

    def prepare(self, requests: Sequence[Request]) -> Any:
        import io

        from PIL import Image

        texts = [self._prompt_text(r) for r in requests]
        if self.text_only:
            if any(r.image is not None for r in requests):
                raise ValueError("text-only transformers backend got an image")
            enc = self.tokenizer(
                texts, return_tensors="pt", padding=True, return_token_type_ids=False
            )
        else:
            if any(r.image is None for r in requests):
                raise ValueError("vision transformers backend needs an image in every request")
            images = [Image.open(io.BytesIO(r.image)).convert("RGB") for r in requests]
            enc = self.processor(
                text=texts,
                images=images,
                return_tensors="pt",
                padding=True,
                return_token_type_ids=False,
            )
        return enc.to(self.device)

    def generate(self, prepared: Any) -> Any:
        g = self.generation
        kwargs: dict[str, Any] = {"max_new_tokens": g.max_tokens, "do_sample": g.temperature > 0}
        if g.temperature > 0:
            kwargs.update(temperature=g.temperature, top_p=g.top_p)
            if g.seed is not None:
                self._torch.manual_seed(g.seed)
        if g.repetition_penalty != 1.0:
            kwargs["repetition_penalty"] = g.repetition_penalty
        if self._grammar is not None:
            # One per generate() call: it holds each row's position in the grammar.
            kwargs["logits_processor"] = [schema_logits_processor(self._grammar)]
        with self._torch.inference_mode():
            out = self.net.generate(**prepared, pad_token_id=self.tokenizer.pad_token_id, **kwargs)
        return out[:, prepared["input_ids"].shape[1] :].cpu()

    def decode(self, raw: Any) -> list[Generation]:
        results = []
        for row in raw.tolist():
            stop = next((i for i, t in enumerate(row) if t in self.eos_ids), None)
            if stop is not None:
                tokens, reason = row[:stop], "stop"
            else:
                tokens = row
                reason = "length" if len(row) >= self.generation.max_tokens else None
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            results.append(Generation(text, reason))
        return results


def schema_logits_processor(grammar: Any) -> Any:
    """A ``transformers`` logits processor that masks what cannot continue ``grammar``.

    Built on xgrammar's matcher API (``GrammarMatcher``, token bitmasks) rather
    than ``xgrammar.contrib.hf``, whose processor hands ``accept_token`` a
    tensor that newer xgrammar releases refuse. Each row keeps its own
    matcher; a row whose sampled token the grammar refuses (it cannot happen
    under the mask, short of a vocabulary mismatch) stops being masked and is
    caught by the validation after generation.
    """
    import transformers
    import xgrammar as xgr

    class SchemaLogitsProcessor(transformers.LogitsProcessor):
        def __init__(self) -> None:
            self.matchers: list = []
            self.live: list[bool] = []
            self.bitmask = None

        def __call__(self, input_ids, scores):
            rows = int(input_ids.shape[0])
            if not self.matchers:
                self.matchers = [xgr.GrammarMatcher(grammar) for _ in range(rows)]
                self.live = [True] * rows
                self.bitmask = xgr.allocate_token_bitmask(rows, grammar.tokenizer_info.vocab_size)
            else:
                for i, m in enumerate(self.matchers):
                    if self.live[i] and not m.is_terminated():
                        self.live[i] = bool(m.accept_token(int(input_ids[i, -1])))
            for i, m in enumerate(self.matchers):
                if self.live[i] and not m.is_terminated():
                    m.fill_next_token_bitmask(self.bitmask, i)
                else:  # finished or off the grammar: leave this row's logits as they are
                    self.bitmask[i].fill_(-1)
            device = scores.device
            masked = scores if device.type in ("cuda", "cpu") else scores.to("cpu")
            xgr.apply_token_bitmask_inplace(masked, self.bitmask.to(masked.device))
            return masked if masked.device == device else masked.to(device)

    return SchemaLogitsProcessor()


def compile_schema(tokenizer: Any, net: Any, json_schema: str, stop_ids: Sequence[int]) -> Any:
    """The schema as an xgrammar grammar over this tokenizer's vocabulary.

    xgrammar (what vLLM itself uses for guided decoding) masks, at every step,
    the tokens that cannot continue a schema-valid JSON text, so even a small
    model stores valid rows on the CPU; the output is still validated after.
    No free whitespace between tokens: a model cannot pad an object forever.
    """
    try:
        import xgrammar as xgr
    except ImportError:  # pragma: no cover - a dependency of the package
        raise BackendUnavailable(
            "--schema with the transformers backend needs xgrammar: pip install xgrammar"
        ) from None
    vocab = int(net.get_output_embeddings().weight.shape[0])
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab, stop_token_ids=list(stop_ids)
    )
    return xgr.GrammarCompiler(info).compile_json_schema(json_schema, any_whitespace=False)


# --- OpenAI-compatible HTTP ------------------------------------------------

#: Statuses worth retrying: rate limits, overload, gateway hiccups.
RETRY_STATUSES = frozenset({408, 409, 429, 500, 502, 503, 504})


def _counting_retry():
    """urllib3's ``Retry`` that reports each retry it takes (the backend counts them)."""
    from urllib3.util.retry import Retry

    class CountingRetry(Retry):
        def __init__(self, *args: Any, on_retry=None, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.on_retry = on_retry

        def new(self, **kw: Any) -> CountingRetry:
            r = super().new(**kw)
            r.on_retry = self.on_retry
            return r

        def increment(self, *args: Any, **kwargs: Any) -> CountingRetry:
            r = super().increment(*args, **kwargs)  # raises once the budget is spent
            if self.on_retry is not None:
                self.on_retry()
            return r

    return CountingRetry


class OpenAIBackend(Backend):
    """``POST {base_url}/chat/completions`` with images as base64 data URLs.

    At most ``concurrency`` requests are in flight per actor (the job's
    total is ``concurrency x replicas``). Retries are urllib3's ``Retry``
    mounted on each thread's ``requests`` session: up to ``max_retries`` on
    408/409/429/5xx, connection errors and read timeouts (POST included),
    exponential backoff from ``backoff`` seconds with jitter, capped at
    ``max_backoff``, and the server's ``Retry-After`` (also capped). A
    request that still fails becomes a per-row error; other rows are
    unaffected.
    """

    name = "openai"

    def __init__(
        self,
        model: str,
        generation: GenerationConfig | None = None,
        *,
        base_url: str = "http://127.0.0.1:8000/v1",
        api_key: str | None = None,
        api_key_env: str = "OPENAI_API_KEY",
        concurrency: int = 8,
        timeout: float = 120.0,
        max_retries: int = 5,
        backoff: float = 1.0,
        max_backoff: float = 60.0,
        extra_body: dict | None = None,
    ):
        super().__init__(model, generation)
        import os

        import requests

        if concurrency < 1:
            raise UsageError(f"concurrency must be >= 1, got {concurrency}")
        if max_retries < 0:
            raise UsageError(f"max_retries must be >= 0, got {max_retries}")
        self._requests = requests
        self.url = base_url.rstrip("/") + "/chat/completions"
        key = api_key or os.environ.get(api_key_env)
        self.headers = {"Content-Type": "application/json"}
        if key:
            self.headers["Authorization"] = f"Bearer {key}"
        self.concurrency = concurrency
        self.timeout = timeout
        self.max_retries = max_retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.extra_body = dict(extra_body or {})
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="openai")
        #: Retries made so far (for reports and tests).
        self.retries = 0
        self._lock = threading.Lock()
        self.retry = _counting_retry()(
            total=max_retries,
            connect=max_retries,
            read=max_retries,
            status=max_retries,
            other=0,
            redirect=0,
            allowed_methods=None,  # POST too: a completion request has no side effects
            status_forcelist=RETRY_STATUSES,
            backoff_factor=backoff,
            backoff_max=max_backoff,
            backoff_jitter=backoff,
            respect_retry_after_header=True,
            retry_after_max=max(1, int(max_backoff)),
            raise_on_status=False,  # the last response becomes the row's error text
            on_retry=self._count_retry,
        )

    def _count_retry(self) -> None:
        with self._lock:
            self.retries += 1

    def _session(self):
        s = getattr(self._local, "session", None)
        if s is None:
            from requests.adapters import HTTPAdapter

            s = self._local.session = self._requests.Session()
            adapter = HTTPAdapter(max_retries=self.retry, pool_maxsize=1)
            s.mount("http://", adapter)
            s.mount("https://", adapter)
        return s

    def prepare(self, requests: Sequence[Request]) -> list[dict]:
        g = self.generation
        payloads = []
        for r in requests:
            body: dict[str, Any] = {
                "model": self.model,
                "messages": chat_messages(r),
                "max_tokens": g.max_tokens,
                "temperature": g.temperature,
                "top_p": g.top_p,
            }
            if g.seed is not None:
                body["seed"] = g.seed
            if g.repetition_penalty != 1.0:
                body["repetition_penalty"] = g.repetition_penalty
            if g.json_schema is not None:
                body["response_format"] = response_format(g.json_schema)
            body.update(self.extra_body)
            payloads.append(body)
        return payloads

    def _post(self, body: dict) -> dict | Exception:
        req = self._requests
        try:
            resp = self._session().post(
                self.url, json=body, headers=self.headers, timeout=self.timeout
            )
        except (req.ConnectionError, req.Timeout) as e:  # retries spent (MaxRetryError inside)
            return RuntimeError(f"http: {type(e).__name__}")
        if resp.status_code != 200:
            return RuntimeError(f"http {resp.status_code}: {resp.text[:200]}")
        try:
            return resp.json()
        except ValueError:
            return RuntimeError("http: response is not JSON")

    def generate(self, prepared: list[dict]) -> list[dict | Exception]:
        return list(self._pool.map(self._post, prepared))

    def decode(self, raw: list[dict | Exception]) -> list[Generation]:
        out = []
        for item in raw:
            if isinstance(item, Exception):
                out.append(Generation(None, None, str(item)))
                continue
            try:
                choice = item["choices"][0]
                text = choice["message"].get("content")
                out.append(Generation(text or "", choice.get("finish_reason")))
            except (KeyError, IndexError, TypeError, AttributeError):
                out.append(Generation(None, None, f"bad response: {json.dumps(item)[:200]}"))
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# --- vLLM offline engine ---------------------------------------------------


class VLLMBackend(Backend):
    """vLLM's offline engine (``vllm.LLM.chat``), one engine per Ray actor.

    ``engine_kwargs`` go to ``vllm.LLM`` (``max_model_len``,
    ``gpu_memory_utilization``, ``tensor_parallel_size``,
    ``mm_processor_kwargs={"max_pixels": ...}``, ...). Images travel as data
    URLs in OpenAI-format chat messages, which vLLM decodes itself.
    """

    name = "vllm"

    def __init__(
        self,
        model: str,
        generation: GenerationConfig | None = None,
        *,
        text_only: bool = False,
        engine_kwargs: dict | None = None,
        chat_template_kwargs: dict | None = None,
    ):
        super().__init__(model, generation)
        self.check_available()
        self.chat_template_kwargs = dict(chat_template_kwargs or {}) or None
        self.engine_kwargs = self.engine_args(engine_kwargs, text_only)
        from vllm import LLM, SamplingParams

        g = self.generation
        extra: dict[str, Any] = {}
        if g.json_schema is not None:
            from vllm.sampling_params import GuidedDecodingParams

            extra["guided_decoding"] = GuidedDecodingParams(json=json.loads(g.json_schema))
        self.sampling = SamplingParams(
            max_tokens=g.max_tokens,
            temperature=g.temperature,
            top_p=g.top_p,
            repetition_penalty=g.repetition_penalty,
            seed=g.seed,
            **extra,
        )
        self.llm = LLM(model=model, **self.engine_kwargs)

    @classmethod
    def check_available(cls) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise BackendUnavailable(
                "the vllm backend needs the 'vllm' package and a CUDA GPU: `pip install vllm` "
                "on the GPU nodes, or use --backend openai against a `vllm serve` endpoint, "
                "or --backend transformers"
            )

    @staticmethod
    def engine_args(engine_kwargs: dict | None, text_only: bool = False) -> dict:
        """Defaults merged with the user's ``engine_kwargs`` (validated, no vllm import)."""
        if not isinstance(engine_kwargs or {}, dict):
            raise UsageError(f"engine_kwargs must be a dict, got {type(engine_kwargs).__name__}")
        kwargs = dict(engine_kwargs or {})
        for key in ("tensor_parallel_size", "pipeline_parallel_size"):
            v = kwargs.get(key, 1)
            if not isinstance(v, int) or v < 1:
                raise UsageError(f"engine_kwargs[{key!r}] must be a positive integer, got {v!r}")
        if not text_only:
            kwargs.setdefault("limit_mm_per_prompt", {"image": 1})
        if VLLMBackend.gpus_per_replica(kwargs) > 1:
            # The actor owns all of its replica's GPUs: vLLM's own worker processes
            # use them directly instead of asking Ray for more.
            kwargs.setdefault("distributed_executor_backend", "mp")
        return kwargs

    @staticmethod
    def gpus_per_replica(engine_kwargs: dict | None) -> int:
        kw = engine_kwargs or {}
        return int(kw.get("tensor_parallel_size", 1)) * int(kw.get("pipeline_parallel_size", 1))

    def prepare(self, requests: Sequence[Request]) -> list[list[dict]]:
        return [chat_messages(r) for r in requests]

    def generate(self, prepared: list[list[dict]]) -> Any:
        return self.llm.chat(
            prepared, self.sampling, use_tqdm=False, chat_template_kwargs=self.chat_template_kwargs
        )

    def decode(self, raw: Any) -> list[Generation]:
        out = []
        for res in raw:
            if not res.outputs:
                out.append(Generation(None, None, "vllm returned no output"))
                continue
            o = res.outputs[0]
            out.append(Generation(o.text, o.finish_reason))
        return out


BACKENDS: dict[str, type[Backend]] = {
    b.name: b for b in (VLLMBackend, OpenAIBackend, TransformersBackend)
}


@dataclass(frozen=True)
class BackendSpec:
    """Everything needed to build a backend inside a Ray actor (picklable).

    ``replicas`` actors each hold ``num_gpus`` GPUs and ``num_cpus`` CPUs;
    ``batch_size`` rows go to one ``Backend.__call__``.
    """

    cls: type[Backend]
    model: str
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    options: dict = field(default_factory=dict)
    replicas: int = 1
    batch_size: int = 16
    num_cpus: float = 1.0
    num_gpus: float = 0.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise UsageError(f"replicas must be >= 1, got {self.replicas}")
        if self.batch_size < 1:
            raise UsageError(f"batch_size must be >= 1, got {self.batch_size}")
        params = inspect.signature(self.cls.__init__).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            unknown = sorted(set(self.options) - set(params) - {"self", "model", "generation"})
            if unknown:
                allowed = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY]
                raise UsageError(
                    f"unknown option(s) {unknown} for the {self.cls.name} backend; "
                    f"allowed: {allowed}"
                )

    def build(self) -> Backend:
        return self.cls(self.model, self.generation, **self.options)


def make_spec(
    backend: str,
    model: str,
    generation: GenerationConfig | None = None,
    options: dict | None = None,
    *,
    replicas: int | None = None,
    batch_size: int | None = None,
    text_only: bool = False,
) -> BackendSpec:
    """Build a validated :class:`BackendSpec` from a backend name.

    Chooses sensible resources per backend: vLLM takes
    ``tensor_parallel_size x pipeline_parallel_size`` GPUs per replica;
    transformers takes one GPU when ``device`` is CUDA; the HTTP backend is
    I/O-bound and takes a quarter CPU.
    """
    if backend not in BACKENDS:
        raise UsageError(f"unknown backend {backend!r}; choose from {sorted(BACKENDS)}")
    if not model:
        raise UsageError("a model name or path is required")
    cls = BACKENDS[backend]
    cls.check_available()
    opts = dict(options or {})
    if "text_only" in inspect.signature(cls.__init__).parameters:
        opts.setdefault("text_only", text_only)
    gen = generation or GenerationConfig()
    num_cpus, num_gpus, default_batch = 1.0, 0.0, 16
    if cls is VLLMBackend:
        VLLMBackend.engine_args(opts.get("engine_kwargs"), opts.get("text_only", False))
        num_gpus = float(VLLMBackend.gpus_per_replica(opts.get("engine_kwargs")))
        # vLLM schedules its own continuous batching: hand it large batches.
        default_batch = 256
    elif cls is OpenAIBackend:
        num_cpus = 0.25
        default_batch = 4 * int(opts.get("concurrency", 8))
    elif cls is TransformersBackend and str(opts.get("device", "auto")).startswith("cuda"):
        num_gpus = 1.0
    return BackendSpec(
        cls,
        model,
        gen,
        opts,
        replicas=replicas or 1,
        batch_size=batch_size or default_batch,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
    )


@dataclass(frozen=True, kw_only=True)
class ModelJobConfig:
    """The settings every model-written column job shares (caption, classify); each
    carries its command-line flag. ``backend_options`` go to the backend's constructor."""

    table: str = flag(REQUIRED, "--table", help="Lance table URI (local path or s3://...)")
    backend: str | None = flag(
        None,
        "--backend",
        choices=tuple(sorted(BACKENDS)),
        help="vllm: offline vLLM engine, one replica per GPU (needs `pip install vllm`); "
        "openai: an OpenAI-compatible /v1/chat/completions endpoint (vllm serve, SGLang, "
        "hosted); transformers: Hugging Face generate, also on CPU",
    )
    model: str | None = flag(
        None,
        "--model",
        help="model name on the Hugging Face Hub, or a local checkpoint path "
        "(for --backend openai: the model name the server expects)",
    )
    limit: int | None = flag(
        None, "--limit", type=int, help="compute at most this many rows (a trial run)"
    )
    #: Values to compute again (statuses or labels), on top of the rows never computed.
    redo: tuple[str, ...] = flag(
        (),
        "--redo",
        type=comma_list,
        help="comma-separated statuses (caption) or labels (classify) to compute again, on "
        "top of the rows never computed (default: none; an ok row is never redone)",
    )
    #: Values to compute again, and nothing else (the rows never computed are left alone).
    only: tuple[str, ...] = flag(
        (),
        "--only",
        type=comma_list,
        help="like --redo, but leave the rows never computed alone: e.g. --only looping "
        "retries the looping rows only",
    )
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    backend_options: dict = field(default_factory=dict)
    replicas: int = flag(
        1,
        "--replicas",
        type=int,
        help="actors running the backend (vllm: one per GPU group) (default: %(default)s)",
    )
    batch_size: int | None = flag(
        None,
        "--batch-size",
        type=int,
        help="rows per backend call (default: vllm 256, openai 4 x concurrency, transformers 16)",
    )
    commit_every: int = flag(
        16,
        "--commit-every",
        type=int,
        help="fragments per commit to the table; each finished fragment is also checkpointed, "
        "so a killed run never recomputes it (default: %(default)s)",
    )
    storage_options: dict | None = None
    #: engine, Ray cluster, CPUs, progress bar: the same for every job (``--engine``, ...).
    run: RunOptions = run_field()

    @property
    def redone(self) -> tuple[str, ...]:
        """The values whose rows are computed again (``redo`` or ``only``)."""
        return self.only or self.redo

    def check(self, known: Sequence[str], what: str) -> None:
        """The shared checks: ``redone`` values among ``known`` (statuses or labels)."""
        if self.redo and self.only:
            raise UsageError("give redo or only, not both")
        bad = set(self.redone) - set(known)
        if bad:
            raise UsageError(f"unknown {what} to redo: {sorted(bad)}; choose from {tuple(known)}")
        if self.limit is not None and self.limit < 0:
            raise UsageError(f"limit must be >= 0, got {self.limit}")
