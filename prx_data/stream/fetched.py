"""What a node's cache already holds of a remote export's catalog, so a start fetches only changes.

The catalog is what the node leader copies before streaming: each bucket's
``index.json``, the chosen skip-list sidecars and the export's ``report.json``.
Each file is downloaded again only when its version (S3 ETag and size, from
the one listing per bucket the fetch makes anyway, or a HEAD for the report;
the modification time on other stores) differs from the one recorded when it
was fetched, or when the cached copy is missing or has another size. A file
gone from the export leaves the cache.

The record (:data:`STATE_NAME`, at the cache root) is written atomically, and
an entry leaves it *before* its file is overwritten, so a fetch killed
part-way never leaves an entry that vouches for bytes it did not fetch.
Shard files are not part of it: :mod:`prx_data.stream.cache` keeps those
bound to the cached index.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping

from prx_data.core import confined, storage
from prx_data.core.schema import REPORT_NAME
from prx_data.export import bounded, layout, naming, safety
from prx_data.skips import sidecar as skiplist
from prx_data.stream import cache as shard_cache

#: At the cache root: {"version": 1, "files": {path: [size, tag]}} of what was fetched.
STATE_NAME = "_prx_fetched.v1.json"


class CatalogCache:
    """The fetch record of one cache directory for one remote export root.

    ``downloads`` counts the files this fetch actually read from the store.
    """

    def __init__(self, root: str, local: str) -> None:
        self.root = root
        self.local = local
        self.downloads = 0
        self._saved = _load(os.path.join(local, STATE_NAME), root)
        self._files = dict(self._saved)
        #: Fetched by this run; recorded only by :meth:`finish`, once every file is written.
        self._pending: dict[str, storage.FileVersion] = {}

    # --- reading -----------------------------------------------------------------------------

    def bucket_listing(self, bucket: str) -> dict[str, storage.FileVersion]:
        """Every file under the remote bucket directory with its version (one listing)."""
        return storage.file_versions(layout.rel_join(self.root, bucket))

    def fresh(self, rel: str, version: storage.FileVersion | None) -> bool:
        """Whether the cached copy of ``rel`` is the remote file of ``version``."""
        if version is None or version.tag is None:
            return False
        if self._files.get(rel) != version:
            return False
        try:
            return os.path.getsize(self._path(rel)) == version.size
        except OSError:
            return False

    def read(self, rel: str, version: storage.FileVersion | None) -> bytes:
        """The bytes of ``rel``: the cached copy when fresh, else fetched (the caller writes it)."""
        if self.fresh(rel, version):
            with open(self._path(rel), "rb") as f:
                return f.read()
        self._forget([rel])
        # Index and report: capped, and keys confined to the export's prefix.
        path = layout.rel_join(self.root, rel)
        data = confined.read(self.root, path, confined.INDEX_MAX_BYTES)
        self.downloads += 1
        if version is not None:
            self._pending[rel] = version
        return data

    def report(self) -> bytes | None:
        """The export's ``report.json`` (None when it has none), fetched only when it changed."""
        version = storage.file_version(storage.join(self.root, REPORT_NAME))
        if version is None:
            self._forget([REPORT_NAME])
            return None
        try:
            return self.read(REPORT_NAME, version)
        except FileNotFoundError:  # removed between the HEAD and the read
            return None

    def sync_sidecars(
        self, bucket: str, want: Iterable[str], listing: Mapping[str, storage.FileVersion]
    ) -> None:
        """Make the bucket's cached sidecars exactly ``want`` (paths in the bucket), as listed.

        Unchanged ones stay; changed and new ones are fetched in parallel;
        every other cached ``*.skip`` file of the bucket is removed.
        """
        local_b = os.path.join(self.local, *bucket.split("/"))
        want = set(want)
        gone = [
            rel.replace(os.sep, "/")
            for rel in storage.list_files(local_b, skiplist.SUFFIX)
            if rel.replace(os.sep, "/") not in want
        ]
        for rel in gone:
            os.remove(os.path.join(local_b, *rel.split("/")))
        stale = sorted(r for r in want if not self.fresh(f"{bucket}/{r}", listing.get(r)))
        self._forget([f"{bucket}/{r}" for r in gone + stale])

        def get(rel: str) -> None:
            path = layout.rel_join(self.root, f"{bucket}/{rel}")
            data = confined.read(self.root, path, confined.INDEX_MAX_BYTES)
            storage.write_bytes_atomic(os.path.join(local_b, *rel.split("/")), data)

        bounded.map_io(get, stale, True)
        self.downloads += len(stale)
        for rel in stale:
            if listing.get(rel) is not None:
                self._pending[f"{bucket}/{rel}"] = listing[rel]

    # --- ending ------------------------------------------------------------------------------

    def finish(self, buckets: Iterable[str], tiers: Iterable[int]) -> None:
        """Record what this run fetched (call it once every file is written) and drop the
        cached catalog of buckets of ``tiers`` the export no longer has."""
        self._files.update(self._pending)
        self._pending = {}
        keep = set(buckets)
        want = {str(int(t)) for t in tiers}
        gone: dict[str, list[str]] = {}
        for rel in self._files:
            bucket = "/".join(rel.split("/")[:2])
            if rel != REPORT_NAME and bucket.split("/")[0] in want and bucket not in keep:
                gone.setdefault(bucket, []).append(rel)
        for bucket, rels in sorted(gone.items()):
            try:
                safety.check_bucket(bucket)
            except ValueError:
                continue  # not a name this module writes: leave it alone
            local_b = os.path.join(self.local, *bucket.split("/"))
            cached = shard_cache.read_cached_index(local_b, naming.INDEX_NAME)
            self._forget(rels)
            # Its shards go too (they belong to the index that left), then its catalog files.
            shard_cache.drop_stale_shards(local_b, cached, [], same_report=False)
            base = os.path.join(os.path.normpath(self.local), "")
            for rel in rels:
                path = os.path.normpath(self._path(rel))
                if path.startswith(base) and os.path.isfile(path):
                    os.remove(path)
        self._save()

    # --- record ------------------------------------------------------------------------------

    def _path(self, rel: str) -> str:
        return os.path.join(self.local, *rel.split("/"))

    def _forget(self, rels: Iterable[str]) -> None:
        """Drop entries, on disk too, before their files change (never vouch for other bytes)."""
        rels = list(rels)
        for r in rels:
            self._pending.pop(r, None)
        rels = [r for r in rels if r in self._files]
        for r in rels:
            del self._files[r]
        if any(r in self._saved for r in rels):
            self._save()

    def _save(self) -> None:
        if self._files == self._saved:
            return
        body = {
            "version": 1,
            "root": self.root,
            "files": {r: [v.size, v.tag] for r, v in sorted(self._files.items())},
        }
        storage.write_bytes_atomic(
            os.path.join(self.local, STATE_NAME), json.dumps(body, sort_keys=True).encode()
        )
        self._saved = dict(self._files)


def _load(path: str, root: str) -> dict[str, storage.FileVersion]:
    """The record, or nothing when absent, unreadable or written for another root."""
    try:
        with open(path, "rb") as f:
            body = json.loads(f.read())
        if body.get("version") != 1 or body.get("root") != root:
            return {}
        return {
            str(r): storage.FileVersion(int(v[0]), None if v[1] is None else str(v[1]))
            for r, v in body["files"].items()
        }
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return {}
