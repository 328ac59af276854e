"""A real-photo benchmark corpus from free Debian packages, as an image folder with captions.

Synthetic ``photo_like`` images decode unlike photos (smooth gradients compress
and resample unlike real detail), so the export benchmarks run on this corpus.

Sources (fetched with ``apt-get download``, unpacked with ``dpkg-deb -x``;
nothing is installed):

  lomiri-wallpapers-16.04   15 JPEG photos, 1.5-16 MP (most progressive)
  lomiri-wallpapers-20.04    4 JPEGs, 9.4-24 MP
  gnome-backgrounds         14 WebP wallpapers, 4096x4096 (renders and
                            illustrations; 2 more are 256x256 and are dropped
                            as too_small by the export), SVGs skipped

That is 35 originals. ``--images N`` (default 320) adds distinct variants of
the 33 originals of at least 1 MP, round robin, until there are N files: a random crop of 60-100 % of each side
(aspect ratio kept within the export's 0.5-2.0), a horizontal flip for every
other variant, and a re-encode in the original's format (JPEG quality 85-95,
progressive when the source was; WebP quality 80-95). Every variant has
different bytes but is still real photo content. The originals are kept
byte-for-byte. The choice of crops is seeded, so the same package versions
and Pillow give the same corpus.

Layout (``OUT``, default ``build/photo_corpus``, git-ignored; do not commit
the photos):

  OUT/images/<package>/<Name>.jpg|webp     originals
  OUT/images/<package>/<Name>~vNN.jpg|webp variants
  OUT/images/<package>/<stem>.txt          caption sidecar (from the file name)
  OUT/manifest.jsonl                       one line per image: path, package,
                                           original, variant, size, sha256
  OUT/debs/                                the downloaded .deb files

Usage:
  python benchmarks/photo_corpus.py                    # 320 images in build/photo_corpus
  python benchmarks/photo_corpus.py --images 35        # originals only
  python -m prx_data.ingest build/photo_corpus/images --table build/photos.lance
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import io
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile

PACKAGES = ("lomiri-wallpapers-16.04", "lomiri-wallpapers-20.04", "gnome-backgrounds")
IMAGE_EXTS = (".jpg", ".jpeg", ".webp", ".png")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "build", "photo_corpus")
#: Originals below this size (the two 256x256 gnome tiles) get no variants.
MIN_VARIANT_PIXELS = 1_000_000


def fetch_debs(debs_dir: str, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """``apt-get download`` each package into ``debs_dir`` (kept between runs)."""
    os.makedirs(debs_dir, exist_ok=True)
    have = {
        os.path.basename(p).split("_")[0]: p for p in glob.glob(os.path.join(debs_dir, "*.deb"))
    }
    missing = [p for p in packages if p not in have]
    if missing:
        if not shutil.which("apt-get"):
            raise SystemExit(
                f"apt-get not found: put the .deb files of {missing} into {debs_dir} by hand"
            )
        r = subprocess.run(
            ["apt-get", "download", *missing], cwd=debs_dir, capture_output=True, text=True
        )
        if r.returncode != 0:
            raise SystemExit(
                f"apt-get download {' '.join(missing)} failed:\n{r.stderr.strip()}\n"
                "(run `apt-get update` first, or put the .deb files into " + debs_dir + ")"
            )
    debs = []
    for p in packages:
        found = sorted(glob.glob(os.path.join(debs_dir, f"{p}_*.deb")))
        if not found:
            raise SystemExit(f"no .deb for {p} in {debs_dir}")
        debs.append(found[-1])
    return debs


def extract_images(deb: str, dest: str) -> list[str]:
    """Unpack one .deb (``dpkg-deb -x``) and return its raster images, sorted."""
    os.makedirs(dest, exist_ok=True)
    subprocess.run(["dpkg-deb", "-x", deb, dest], check=True)
    found = []
    for root, _, files in os.walk(dest):
        for f in files:
            if f.lower().endswith(IMAGE_EXTS):
                found.append(os.path.join(root, f))
    return sorted(found, key=lambda p: os.path.basename(p))


def caption_for(name: str) -> str:
    """``Bridge_by_Sander_Klootwijk.jpg`` -> ``Bridge, by Sander Klootwijk``; ``wood-d.webp`` -> ``wood (dark)``."""
    stem = os.path.splitext(name)[0]
    m = re.match(r"(.+?)_by_+(.+)", stem)
    if m:
        title, author = m.group(1), m.group(2)
        return f"{title.replace('_', ' ').replace('-', ' ')}, by {author.replace('_', ' ')}"
    m = re.match(r"(.+)-([dl])$", stem)
    if m:
        return f"{m.group(1).replace('-', ' ')} ({'dark' if m.group(2) == 'd' else 'light'})"
    return stem.replace("_", " ").replace("-", " ")


def make_variant(data: bytes, rng: random.Random, flip: bool) -> bytes:
    """A distinct re-encoding of a random crop (60-100 % per side) of ``data``."""
    from PIL import Image, ImageOps

    im = Image.open(io.BytesIO(data))
    fmt = im.format
    progressive = bool(im.info.get("progressive") or im.info.get("progression"))
    im = ImageOps.exif_transpose(im.convert("RGB"))
    w, h = im.size
    for _ in range(20):
        cw = round(w * rng.uniform(0.6, 1.0))
        ch = round(h * rng.uniform(0.6, 1.0))
        if 0.5 <= cw / ch <= 2.0:
            break
    else:
        cw, ch = w, h
    x0, y0 = rng.randint(0, w - cw), rng.randint(0, h - ch)
    im = im.crop((x0, y0, x0 + cw, y0 + ch))
    if flip:
        im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    buf = io.BytesIO()
    if fmt == "WEBP":
        im.save(buf, "WEBP", quality=rng.randint(80, 95), method=2)
    else:
        im.save(buf, "JPEG", quality=rng.randint(85, 95), progressive=progressive, optimize=False)
    return buf.getvalue()


def build(out: str, images: int = 320, seed: int = 0, debs_dir: str | None = None) -> dict:
    """Fetch, unpack and lay out the corpus under ``out``; returns a summary."""
    debs_dir = debs_dir or os.path.join(out, "debs")
    debs = fetch_debs(debs_dir)
    img_root = os.path.join(out, "images")
    if os.path.exists(img_root):
        shutil.rmtree(img_root)
    originals: list[tuple[str, str]] = []  # (package, path)
    with tempfile.TemporaryDirectory(prefix="photo_corpus_") as tmp:
        for pkg, deb in zip(PACKAGES, debs, strict=True):
            for p in extract_images(deb, os.path.join(tmp, pkg)):
                dst_dir = os.path.join(img_root, pkg)
                os.makedirs(dst_dir, exist_ok=True)
                dst = os.path.join(dst_dir, os.path.basename(p))
                shutil.copyfile(p, dst)
                originals.append((pkg, dst))
    if not originals:
        raise SystemExit("the packages held no images")
    rows = []

    def add(pkg: str, path: str, original: str, variant: int, data: bytes) -> None:
        from PIL import Image

        stem = os.path.splitext(path)[0]
        with open(stem + ".txt", "w") as f:
            f.write(caption_for(original) + "\n")
        w, h = Image.open(io.BytesIO(data)).size
        rows.append(
            {
                "path": os.path.relpath(path, img_root),
                "package": pkg,
                "original": original,
                "variant": variant,
                "width": w,
                "height": h,
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )

    sources = []
    for pkg, path in originals:
        with open(path, "rb") as f:
            data = f.read()
        add(pkg, path, os.path.basename(path), 0, data)
        if rows[-1]["width"] * rows[-1]["height"] >= MIN_VARIANT_PIXELS:
            sources.append((pkg, path, data))
    # Variants round-robin over the originals until `images` files exist.
    rng = random.Random(seed)
    k = 0
    while len(rows) < images:
        pkg, path, data = sources[k % len(sources)]
        variant = k // len(sources) + 1
        k += 1
        base, ext = os.path.splitext(path)
        dst = f"{base}~v{variant:02d}{ext}"
        vdata = make_variant(data, rng, flip=variant % 2 == 1)
        with open(dst, "wb") as f:
            f.write(vdata)
        add(pkg, dst, os.path.basename(path), variant, vdata)
    rows.sort(key=lambda r: r["path"])
    with open(os.path.join(out, "manifest.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=True) + "\n")
    shas = {r["sha256"] for r in rows}
    summary = {
        "out": out,
        "images": len(rows),
        "originals": len(originals),
        "distinct_bytes": len(shas),
        "by_package": {p: sum(r["package"] == p for r in rows) for p in PACKAGES},
        "megapixels_min_median_max": _mp_stats(rows),
    }
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    return summary


def _mp_stats(rows: list[dict]) -> list[float]:
    mp = sorted(r["width"] * r["height"] / 1e6 for r in rows)
    return [round(mp[0], 2), round(mp[len(mp) // 2], 2), round(mp[-1], 2)]


def load(out: str = DEFAULT_OUT) -> list[tuple[str, bytes, str]]:
    """(id, bytes, caption) for every image of a built corpus, sorted by path."""
    img_root = os.path.join(out, "images")
    manifest = os.path.join(out, "manifest.jsonl")
    if not os.path.exists(manifest):
        raise SystemExit(
            f"no photo corpus at {out}: build it with `python benchmarks/photo_corpus.py --out {out}`"
        )
    items = []
    with open(manifest) as f:
        for line in f:
            r = json.loads(line)
            path = os.path.join(img_root, r["path"])
            with open(path, "rb") as g:
                data = g.read()
            with open(os.path.splitext(path)[0] + ".txt") as g:
                caption = g.read().strip()
            items.append((f"photos/{os.path.splitext(r['path'])[0]}", data, caption))
    return items


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=DEFAULT_OUT, help="Output folder (default: %(default)s).")
    p.add_argument(
        "--images",
        type=int,
        default=320,
        help="Total images, originals included (default: 320; at most 35 are originals).",
    )
    p.add_argument("--seed", type=int, default=0, help="Seed for the variants (default: 0).")
    p.add_argument(
        "--debs", default=None, help="Folder for the .deb files (default: OUT/debs; reused)."
    )
    args = p.parse_args(argv)
    summary = build(args.out, args.images, args.seed, args.debs)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
