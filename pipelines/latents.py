"""Precompute VAE latents for an export, so a latent-space trainer stops encoding every step.

Graph (:func:`prx_data.core.runtime.map_units`)::

    driver: the export's merged indexes -> one unit per MDS shard
      -> unit (a driver thread or a Ray actor holding the VAE): skip when the
         shard's .npy exists with the digest the record names and the shard is the
         one it was made from; else read the shard, decode each JPEG exactly as the
         loader does, encode in batches with LatentCodec.encode, write the .npy
         atomically
      -> driver: _latents/record.json rewritten every few units and at the end

The shards are not touched (:mod:`prx_data.export.latents` says where the files
live and why). A run holds its own lease (``_latents/.lock``), not the export's:
skip-list updates go on meanwhile, and a shard an export run replaced under it
no longer matches the binding its latents were recorded with. A killed run keeps every ``.npy`` the record names; a rerun
checks them by digest and encodes only the rest. A record made with another
VAE is refused unless ``replace``.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from prx_data.core import confined
from prx_data.core.buckets import parse_bucket_name
from prx_data.core.errors import PrxDataError, UsageError
from prx_data.core.flags import REQUIRED, comma_ints, flag
from prx_data.core.lease import Lease, LeaseHeld
from prx_data.core.reports import JobReport
from prx_data.core.runtime import Resources, RunOptions, map_units, run_field
from prx_data.export import bound
from prx_data.export import latents as L
from prx_data.export.layout import check_export_complete, list_buckets, read_index_entries
from prx_data.export.layout import read_report as read_export_report

#: Samples up to which ``--engine auto`` encodes on a driver thread instead of Ray.
SMALL_SAMPLES = 20_000
#: Rewrite the record after this many finished units (and at the end).
RECORD_EVERY_UNITS = 64
RECORD_EVERY_S = 30.0
#: Threads decoding a batch's JPEGs for one VAE (a GPU encodes faster than one core decodes).
DECODE_THREADS = min(8, os.cpu_count() or 1)
_COMPUTE_DTYPES = ("auto", "float32", "bfloat16", "float16")


class LatentsLocked(LeaseHeld):
    """Another latents run holds this export's latents lease (``_latents/.lock``)."""


@dataclass(frozen=True)
class LatentsConfig:
    """One latents run over an export (fields carry their command-line flags)."""

    out: str = flag(
        REQUIRED, "out", metavar="OUT", help="Export root (python -m prx_data.write_mds --out)."
    )
    vae: str = flag(
        REQUIRED,
        "--vae",
        help="diffusers AutoencoderKL / AutoencoderDC: a local folder or a hub id (the one the "
        "trainer's vae.name_or_path names).",
    )
    vae_subfolder: str | None = flag(
        None, "--vae-subfolder", help="Folder inside --vae (e.g. 'vae' of a pipeline repo)."
    )
    dtype: str = flag(
        "float16",
        "--dtype",
        choices=L.DTYPES,
        help="Storage dtype of the latents (default: %(default)s; float32 doubles the bytes).",
    )
    compute_dtype: str = flag(
        "auto",
        "--compute-dtype",
        choices=_COMPUTE_DTYPES,
        help="dtype the VAE runs in: auto = bfloat16 on CUDA, float32 on CPU, as the "
        "trainer's vae.dtype: auto (default: %(default)s).",
    )
    batch_size: int = flag(
        32, "--batch-size", type=int, help="Images per encoder call (default: %(default)s)."
    )
    device: str = flag(
        "auto",
        "--device",
        help="Torch device of the VAE: auto (CUDA when there is one), cpu, cuda.",
    )
    replace: bool = flag(
        False,
        "--replace",
        help="Encode every shard again when the export's latents were made with another VAE "
        "(without it such a run is refused).",
    )
    tiers: tuple[int, ...] | None = flag(
        None,
        "--tiers",
        type=comma_ints,
        help="Comma-separated tiers to encode (default: all); a run at 512 needs only 512. "
        "Latents of the other tiers already made stay in the record.",
    )
    #: engine, Ray cluster, CPUs, progress bar: the same for every job (``--engine``, ...).
    run: RunOptions = run_field()

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise UsageError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.dtype not in L.DTYPES:
            raise UsageError(f"--dtype {self.dtype!r}: one of {', '.join(L.DTYPES)}")
        if self.compute_dtype not in _COMPUTE_DTYPES:
            raise UsageError(
                f"--compute-dtype {self.compute_dtype!r}: one of {', '.join(_COMPUTE_DTYPES)}"
            )


@dataclass
class LatentsReport(JobReport):
    """What a run encoded and what it found already done."""

    out: str
    vae: dict = field(default_factory=dict)
    dtype: str = "float16"
    shards: int = 0
    samples: int = 0
    encoded_shards: int = 0
    skipped_shards: int = 0
    encoded_samples: int = 0
    bytes_written: int = 0
    seconds: float = 0.0

    counted = "shards"
    job_label = "latents"

    @property
    def total(self) -> int:
        return self.shards

    @property
    def samples_per_s(self) -> float:
        return self.encoded_samples / self.seconds if self.seconds else 0.0

    def text(self) -> str:
        per = self.bytes_written / self.encoded_samples if self.encoded_samples else 0
        return (
            f"latents of {self.out} ({self.vae.get('class')}, {self.dtype}): {self.shards:,} "
            f"shards, {self.samples:,} samples; encoded {self.encoded_shards:,} shards "
            f"({self.encoded_samples:,} samples, {self.samples_per_s:.1f} samples/s, "
            f"{per / 1024:.1f} KiB per sample), already done {self.skipped_shards:,}; "
            f"{self.seconds:.1f}s"
        )


def _device(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class ShardEncoder:
    """One VAE per driver thread or Ray actor; called with a unit, returns the shard's result.

    Args:
        settings: :class:`LatentsConfig` fields as a dict (travels as JSON to Ray actors).
    """

    def __init__(self, settings: dict[str, Any]) -> None:
        from prx_data.train.vae import LatentCodec

        self.cfg = LatentsConfig(**{**settings, "run": RunOptions(**settings["run"])})
        self.device = _device(self.cfg.device)
        self._pool = None
        self.codec = LatentCodec.from_pretrained(
            self.cfg.vae,
            subfolder=self.cfg.vae_subfolder,
            dtype=self.cfg.compute_dtype,
            device=self.device,
            posterior="mode",
        )

    def __call__(self, unit: dict[str, Any]) -> dict[str, Any]:
        root, key, entry = self.cfg.out, unit["key"], unit["entry"]
        binding = L.shard_binding(entry)
        expect = unit.get("expect")
        if expect and bound.matches(expect, binding):
            most = int(expect.get("npy_bytes", 0)) or 1 << 40
            if L.npy_digest(root, key, most) == expect.get("xxh64"):
                return {"key": key, "skipped": True, "record": expect}
        latents = self.encode_shard(unit["bucket"], entry)
        stored = L.to_stored(latents, self.cfg.dtype)
        digest, nbytes = L.write_npy(root, key, stored)
        record = {
            **binding,
            "xxh64": digest,
            "npy_bytes": nbytes,
            "shape": list(stored.shape),
        }
        return {"key": key, "skipped": False, "record": record}

    def encode_shard(self, bucket: str, entry: dict[str, Any]) -> np.ndarray:
        """``[samples, C, H/f, W/f]`` float32 latents of one shard, in its sample order."""
        import torch

        from prx_data.stream.decode import decode_chw
        from prx_data.train.flow import uint8_to_unit

        b = parse_bucket_name(bucket)
        shape = (b.width, b.height)
        where = entry["raw_data"]["basename"]

        def decode(item: tuple[int, bytes]) -> torch.Tensor:
            i, data = item
            try:
                return decode_chw(data, shape)
            except PrxDataError as e:
                raise L.LatentsError(f"{bucket}/{where} sample {i}: {e}") from None

        out = []
        with _shard_reader(self.cfg.out, bucket, entry) as reader:
            n = int(entry["samples"])
            for start in range(0, n, self.cfg.batch_size):
                stop = min(n, start + self.cfg.batch_size)
                raw = [(i, reader.get_item(i)["image"]) for i in range(start, stop)]
                # libjpeg releases the GIL: decode a batch on threads while one VAE encodes.
                images = list(self._decoders().map(decode, raw))
                x = uint8_to_unit(torch.stack(images).to(self.device))
                out.append(self.codec.encode(x).cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0,), np.float32)

    def _decoders(self):
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="prx-latents-decode")
        return self._pool

    def close(self) -> None:
        self.codec = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class _shard_reader:
    """A streaming MDS reader over one shard of a local export (a compressed one decompressed
    into a temporary folder, read confined to the export and to its declared size)."""

    def __init__(self, root: str, bucket: str, entry: dict[str, Any]) -> None:
        self.root, self.bucket, self.entry = root, bucket, entry
        self.tmp: tempfile.TemporaryDirectory | None = None

    def __enter__(self):
        from prx_data.core.streaming_compat import decompress, reader_from_json

        bdir = os.path.join(self.root, *self.bucket.split("/"))
        raw = self.entry["raw_data"]["basename"]
        if os.path.isfile(os.path.join(bdir, *raw.split("/"))) or not self.entry.get("zip_data"):
            return reader_from_json(bdir, None, self.entry)
        z = self.entry["zip_data"]
        data = decompress(
            self.entry["compression"],
            confined.read(
                self.root, os.path.join(bdir, *z["basename"].split("/")), int(z["bytes"])
            ),
        )
        self.tmp = tempfile.TemporaryDirectory(prefix="prx-latents-")
        path = os.path.join(self.tmp.name, *raw.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        return reader_from_json(self.tmp.name, None, self.entry)

    def __exit__(self, *exc) -> None:
        if self.tmp is not None:
            self.tmp.cleanup()


def plan_units(root: str) -> list[dict[str, Any]]:
    """One unit per MDS shard of every bucket: ``{"key", "bucket", "entry"}``."""
    units = []
    for bucket in list_buckets(root):
        for entry in read_index_entries(root, bucket):
            key = L.shard_key(bucket, entry["raw_data"]["basename"])
            units.append({"key": key, "bucket": bucket, "entry": entry})
    return units


def _check_output(cfg: LatentsConfig) -> None:
    from prx_data.core import storage

    if storage.is_remote(cfg.out):
        raise UsageError(
            f"{cfg.out}: the latents job writes next to a local export; run it where the export "
            "is on disk (then upload the _latents folder with it)"
        )
    check_export_complete(cfg.out, read_export_report(cfg.out))
    if cfg.tiers is not None:
        # A tier the export lacks would encode nothing and exit 0: say which it has.
        have = sorted({int(b.split("/")[0]) for b in list_buckets(cfg.out)})
        missing = [int(t) for t in cfg.tiers if int(t) not in have]
        if missing:
            raise UsageError(
                f"--tiers {','.join(map(str, missing))}: {cfg.out} has no such tier; its tiers: "
                f"{','.join(map(str, have)) or 'none'}"
            )


def run_latents(cfg: LatentsConfig) -> LatentsReport:
    """Encode every shard of ``cfg.out`` that has no up-to-date latents; write the record.

    Args:
        cfg: the run (:class:`LatentsConfig`).

    Returns:
        The :class:`LatentsReport`: shards and samples encoded, skipped, throughput.

    Raises:
        LatentsError: the export's latents were made with another VAE (without ``replace``).
        UsageError: a remote or unfinished export.
    """
    t0 = time.monotonic()
    _check_output(cfg)
    os.makedirs(os.path.join(cfg.out, L.LATENTS_DIR), exist_ok=True)
    lock = os.path.join(cfg.out, *L.LOCK_NAME.split("/"))
    # Not the export's lease: a run takes hours and skip-list updates must not wait for it.
    with Lease(lock, what="latents run", error=LatentsLocked):
        every = plan_units(cfg.out)
        wanted = None if cfg.tiers is None else {int(t) for t in cfg.tiers}
        units = [u for u in every if wanted is None or int(u["bucket"].split("/")[0]) in wanted]
        identity = _identity(cfg)
        previous = L.read_record(cfg.out)
        done: dict[str, dict] = {}
        if previous is not None:
            diff = L.vae_differences(previous.get("vae") or {}, identity)
            if previous.get("dtype") != cfg.dtype:
                diff.append(f"dtype {previous.get('dtype')!r} -> {cfg.dtype!r}")
            if diff and not cfg.replace:
                raise L.LatentsError(
                    f"{cfg.out}: its latents were made with another VAE ({'; '.join(diff)}); "
                    "pass --replace to encode them all again"
                )
            if not diff:
                done = dict(previous.get("shards") or {})
        keys = {u["key"] for u in every}
        shards = {k: v for k, v in done.items() if k in keys}
        moved = _follow_content(cfg.out, every, done, shards)
        # Latents this job wrote for shards the export no longer has (an --overwrite export
        # made new parts): removed, then dropped from the record.
        gone = [k for k in (previous or {}).get("shards") or {} if k not in keys]
        for key in gone:  # keys checked by read_record; deleted inside _latents only
            L.delete_npy(cfg.out, key)
        if gone or moved:
            L.write_record(cfg.out, identity, cfg.dtype, shards)
        for u in units:
            if u["key"] in shards:
                u["expect"] = shards[u["key"]]
        report = LatentsReport(
            out=cfg.out,
            vae=identity,
            dtype=cfg.dtype,
            shards=len(units),
            samples=sum(int(u["entry"]["samples"]) for u in units),
        )
        placement = cfg.run.place(
            size=report.samples,
            small=SMALL_SAMPLES,
        )
        resources = _resources(placement, cfg)
        last, since = time.monotonic(), 0
        try:
            for r in map_units(
                ShardEncoder,
                units,
                placement,
                resources,
                desc="latents",
                progress=cfg.run.progress,
                unit_name="shard",
            ):
                shards[r["key"]] = r["record"]
                if r["skipped"]:
                    report.skipped_shards += 1
                else:
                    report.encoded_shards += 1
                    report.encoded_samples += int(r["record"]["samples"])
                    report.bytes_written += int(r["record"]["npy_bytes"])
                    since += 1
                if since >= RECORD_EVERY_UNITS or time.monotonic() - last > RECORD_EVERY_S:
                    L.write_record(cfg.out, identity, cfg.dtype, shards)
                    last, since = time.monotonic(), 0
        finally:
            L.write_record(cfg.out, identity, cfg.dtype, shards)
    report.seconds = time.monotonic() - t0
    return report


def _follow_content(
    root: str, every: list[dict[str, Any]], done: dict[str, dict], shards: dict[str, dict]
) -> int:
    """Latents recorded for a shard path the export no longer has, whose shard is now at
    another path with the same content (samples, bytes and hashes): moved there, not
    encoded again. Returns how many moved; ``shards`` gains them.

    Latents belong to a shard's data, not to its folder: an export of an older version
    (parts named by fragment ids) made again gives the same shards under new names. Only
    shards with content hashes are matched (bytes alone would not tell two apart); the
    moved file is still checked by its digest before it is trusted (:class:`ShardEncoder`).
    """

    def content(binding: dict) -> str | None:
        hashes = binding.get("shard_hashes") or {}
        if not hashes:
            return None
        return repr((binding.get("samples"), binding.get("shard_bytes"), sorted(hashes.items())))

    keys = {u["key"] for u in every}
    orphans: dict[str, str] = {}
    for key, rec in sorted(done.items()):
        c = content(rec)
        if key not in keys and c is not None:
            orphans.setdefault(c, key)
    moved = 0
    for u in every:
        if u["key"] in shards or not orphans:
            continue
        old = orphans.pop(content(L.shard_binding(u["entry"])) or "", None)
        if old is not None and L.move_npy(root, old, u["key"]):
            shards[u["key"]] = done[old]
            moved += 1
    return moved


def _identity(cfg: LatentsConfig) -> dict[str, Any]:
    """The record's ``vae``: the codec's identity and where the VAE came from."""
    from prx_data.train.vae import LatentCodec

    try:
        codec = LatentCodec.from_pretrained(
            cfg.vae, subfolder=cfg.vae_subfolder, dtype="float32", device="cpu", posterior="mode"
        )
    except ValueError as e:  # not found, not an autoencoder: the user's to fix
        raise L.LatentsError(str(e).replace("vae.name_or_path", "--vae")) from None
    return {"name_or_path": cfg.vae, "subfolder": cfg.vae_subfolder, **codec.identity()}


def _resources(placement: Any, cfg: LatentsConfig) -> Resources:
    settings = (asdict(cfg),)
    if not placement.on_ray:
        return Resources(actors=1, constructor_args=settings)
    from prx_data.core.runtime import ensure_ray

    ensure_ray(placement.ray_address, placement.num_cpus)
    import ray

    gpus = int(ray.cluster_resources().get("GPU", 0)) if cfg.device != "cpu" else 0
    return Resources(
        num_cpus=1.0,
        num_gpus=1.0 if gpus else 0.0,
        actors=max(1, gpus),
        constructor_args=settings,
    )
