#!/usr/bin/env python3
"""Writes THIRD-PARTY-NOTICES: the licenses of the crates built into the gpu-dra binary.

The MIT, BSD and Apache-2.0 licenses of those crates ask that their notices travel with every copy of the binary;
the image (/usr/share/doc/gpu-dra/) and the release artifacts (make dist) carry this file beside gpu-dra's LICENSE.

    e2e/third_party_notices.py           write THIRD-PARTY-NOTICES at the repository's root
    e2e/third_party_notices.py --check   fail when it is not what Cargo.lock gives (make lint runs this)

The crates are gpu-dra's normal dependencies, followed transitively, on the platforms the image is built for
(`cargo metadata --locked`): build-time dependencies (build scripts, the .proto compiler) and test dependencies are
not in the binary and are not listed. Each crate's texts are the license files it ships (LICENSE*, LICENCE*, COPYING*,
NOTICE*, COPYRIGHT*, UNLICENSE*, the file its manifest names, and a LICENSES/ directory); a text shipped by several
crates is written once. A crate that ships none is listed with its license expression and authors, and counted.
The output depends on Cargo.lock only: crates in sorted order, no dates, line endings made LF.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTICES = "THIRD-PARTY-NOTICES"
# The platforms the image is built for (the Dockerfile's runtime stage; amd64 and arm64 nodes).
PLATFORMS = ("x86_64-unknown-linux-gnu", "aarch64-unknown-linux-gnu")
LICENSE_FILE = re.compile(r"^(licen[cs]e|copying|notice|copyright|unlicense)([-_.].*)?$", re.IGNORECASE)
RULE = "-" * 118


class NoticesError(Exception):
    """Bad input or a stale file: the message says what is wrong and what to do."""


@dataclasses.dataclass
class Crate:
    name: str
    version: str
    license: str
    repository: str
    authors: list[str]
    texts: list[tuple[str, str]]  # (file name in the crate, text)


def metadata() -> dict:
    command = ["cargo", "metadata", "--locked", "--format-version", "1"]
    for platform in PLATFORMS:
        command += ["--filter-platform", platform]
    try:
        done = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
    except FileNotFoundError as e:
        raise NoticesError("cargo is not on PATH: install the toolchain rust-toolchain.toml names") from e
    except subprocess.CalledProcessError as e:
        raise NoticesError(f"`{' '.join(command)}` failed: {e.stderr.strip()}") from e
    return json.loads(done.stdout)


def shipped(packages: dict, resolve: dict, root: str) -> list[str]:
    """The package IDs reached from `root` through normal (not build, not dev) dependencies, `root` excluded."""
    nodes = {node["id"]: node for node in resolve["nodes"]}
    seen, queue = {root}, [root]
    while queue:
        for dep in nodes[queue.pop()]["deps"]:
            normal = any(kind["kind"] is None for kind in dep["dep_kinds"])
            if normal and dep["pkg"] not in seen:
                seen.add(dep["pkg"])
                queue.append(dep["pkg"])
    seen.discard(root)
    return sorted(seen, key=lambda id: (packages[id]["name"], packages[id]["version"]))


def text_of(path: pathlib.Path) -> str:
    text = path.read_bytes().decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n")
    return "\n".join(line.rstrip() for line in text.strip("\n").split("\n")) + "\n"


def license_texts(package: dict) -> list[tuple[str, str]]:
    directory = pathlib.Path(package["manifest_path"]).parent
    files = {p for p in directory.iterdir() if p.is_file() and LICENSE_FILE.match(p.name)}
    if package.get("license_file"):
        named = directory / package["license_file"]
        if named.is_file():
            files.add(named)
    licenses = directory / "LICENSES"
    if licenses.is_dir():
        files.update(p for p in licenses.iterdir() if p.is_file())
    return [(str(p.relative_to(directory)), text_of(p)) for p in sorted(files)]


def crates() -> list[Crate]:
    meta = metadata()
    packages = {p["id"]: p for p in meta["packages"]}
    root = meta["resolve"]["root"] if meta["resolve"] else None
    if root is None or packages[root]["name"] != "gpu-dra":
        raise NoticesError(f"cargo metadata in {ROOT} does not describe the gpu-dra package: run it from a checkout")
    found = []
    for id in shipped(packages, meta["resolve"], root):
        p = packages[id]
        found.append(
            Crate(
                name=p["name"],
                version=p["version"],
                license=p.get("license") or "(none declared)",
                repository=p.get("repository") or "",
                authors=p.get("authors") or [],
                texts=license_texts(p),
            )
        )
    return found


def digest(text: str) -> str:
    """Texts that differ only in their line breaks and spacing (a license re-wrapped) are one text."""
    return hashlib.sha256(" ".join(text.split()).encode()).hexdigest()


def render(found: list[Crate]) -> str:
    texts: dict[str, tuple[str, list[str]]] = {}  # digest -> (text, the crates and files shipping it)
    keys: list[set[str]] = []  # the digests of each crate's texts, in the order of `found`
    for crate in found:
        keys.append(set())
        for file_name, text in crate.texts:
            key = digest(text)
            keys[-1].add(key)
            texts.setdefault(key, (text, []))[1].append(f"{crate.name} {crate.version} ({file_name})")
    number = {key: i + 1 for i, key in enumerate(sorted(texts, key=lambda key: texts[key][1][0]))}
    without = [c for c in found if not c.texts]
    out = [
        "Third-party software in gpu-dra",
        "",
        "gpu-dra is licensed under the Apache License 2.0 (LICENSE). Its binary is built from the Rust crates listed",
        "below, each under the license its authors chose (an SPDX expression: `A OR B` lets the user pick one), whose",
        "texts follow. Written by e2e/third_party_notices.py from Cargo.lock: do not edit by hand.",
        "",
        f"{len(found)} crates; {len(texts)} distinct license texts; "
        f"{len(without)} crates ship no license file (their license and authors are listed).",
        "",
        RULE,
        "Crates",
        RULE,
    ]
    for crate, crate_keys in zip(found, keys):
        refs = sorted(number[key] for key in crate_keys)
        if refs:
            where = "texts " + ", ".join(f"[{n}]" for n in refs)
        else:
            where = "no license file; authors: " + (", ".join(crate.authors) or "(none listed)")
        repository = crate.repository or "(no repository listed)"
        out.append(f"{crate.name} {crate.version}: {crate.license}; {repository}; {where}")
    for key in sorted(texts, key=number.__getitem__):
        text, shippers = texts[key]
        out += ["", RULE, f"[{number[key]}] shipped by {', '.join(shippers)}", RULE, text.rstrip("\n")]
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help=f"fail when {NOTICES} is not what Cargo.lock gives")
    parser.add_argument("--file", default=str(ROOT / NOTICES), help=f"the file to write or check ({NOTICES})")
    args = parser.parse_args()
    path = pathlib.Path(args.file)
    try:
        wanted = render(crates())
        if not args.check:
            path.write_text(wanted, encoding="utf-8")
            return 0
        try:
            current = path.read_text(encoding="utf-8")
        except OSError as e:
            what = f"cannot read {path} ({e.strerror})"
            raise NoticesError(f"{what}: run e2e/third_party_notices.py and commit the file it writes") from e
        if current != wanted:
            raise NoticesError(
                f"{path} is not what Cargo.lock gives (a dependency was added, removed or updated, or the file was "
                "edited): run e2e/third_party_notices.py and commit the file it writes"
            )
        return 0
    except NoticesError as e:
        print(f"third_party_notices: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
