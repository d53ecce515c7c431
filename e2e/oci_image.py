#!/usr/bin/env python3
"""Builds OCI image-layout archives without a container engine or a registry (see e2e/build-images.sh).

Every archive is deterministic: the same inputs give the same bytes, hence the same digests. Tar entries are sorted,
have mtime 0 and numeric owners without names; gzip streams carry no name and mtime 0; JSON is written with sorted
keys and no whitespace.

The gpu-dra image is the Dockerfile's runtime stage, read from the Dockerfile itself so that the two cannot drift:
its LABEL, ARG, USER, ENTRYPOINT and `COPY --from=<build stage>` are applied as a container engine would; the base
image (distroless/cc, which cannot be pulled here) is stood in for by the C runtime the binary links (`ldd`) and the
users distroless defines. An instruction this builder does not know is an error, never silently skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import io
import json
import os
import pathlib
import re
import shlex
import struct
import subprocess
import sys
import tarfile

# The bases whose content this builder stands in for, and why that stand-in is faithful: distroless/cc is glibc,
# libgcc and the users root/nonroot/nobody; the binary needs no more of it (no shell, no CA bundle: in-cluster
# configuration carries its own CA).
STAND_IN_BASES = ("gcr.io/distroless/cc-debian12:nonroot",)
# The label naming an image's base: the stand-in is not that base (its C library is the build machine's, with no
# package records a scanner could read), so the label is replaced by STAND_IN_LABEL saying what it is instead.
BASE_NAME_LABEL = "org.opencontainers.image.base.name"
STAND_IN_LABEL = "dev.gpu-dra.image.base-stand-in"
# What the runtime stage may contain; anything else is refused with the line that has it.
RUNTIME_INSTRUCTIONS = ("FROM", "ARG", "LABEL", "COPY", "USER", "ENTRYPOINT")
# distroless's PATH, so that `kubectl exec` and probes resolve commands the same way on both images.
DEFAULT_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# distroless's /etc/passwd and /etc/group (root, nobody, nonroot 65532): `USER 65532:65532` names an existing user.
PASSWD = (
    "root:x:0:0:root:/root:/sbin/nologin\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\n"
    "nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n"
)
GROUP = "root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n"
BUSYBOX_PASSWD = "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
BUSYBOX_GROUP = "root:x:0:\nnobody:x:65534:\n"
# The pause container: PID 1 of the pod sandbox; it waits for a signal without polling (`wait` on a sleep that
# never ends returns when the trapped TERM or INT arrives) and exits 0 on it, as registry.k8s.io/pause does.
PAUSE_ENTRYPOINT = ["/bin/sh", "-c", "trap 'exit 0' TERM INT; sleep 2147483647 & wait"]

MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar+gzip"
GOARCH = {"x86_64": "amd64", "aarch64": "arm64"}


class BuildError(Exception):
    """Bad input: the message says what is wrong and what to do."""


# --- deterministic layers -----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Entry:
    """One path of a layer: a directory, a regular file (data) or a symlink (target)."""

    path: str
    mode: int
    kind: bytes = tarfile.REGTYPE
    data: bytes = b""
    target: str = ""
    uid: int = 0
    gid: int = 0


def directory(path: str, mode: int = 0o755, uid: int = 0, gid: int = 0) -> Entry:
    return Entry(path.strip("/"), mode, tarfile.DIRTYPE, uid=uid, gid=gid)


def file(path: str, data: bytes, mode: int = 0o644) -> Entry:
    return Entry(path.strip("/"), mode, tarfile.REGTYPE, data=data)


def symlink(path: str, target: str) -> Entry:
    return Entry(path.strip("/"), 0o777, tarfile.SYMTYPE, target=target)


def tar_bytes(entries: list[Entry]) -> bytes:
    """A tar of the entries and their parent directories (0755, root), sorted, mtime 0, numeric owners only."""
    by_path = {e.path: e for e in entries}
    for e in entries:
        parts = e.path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            by_path.setdefault("/".join(parts[:i]), directory("/".join(parts[:i])))
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(by_path):
            e = by_path[path]
            info = tarfile.TarInfo(path)
            info.type, info.mode, info.uid, info.gid, info.mtime = e.kind, e.mode, e.uid, e.gid, 0
            info.uname = info.gname = ""
            if e.kind == tarfile.SYMTYPE:
                info.linkname = e.target
            info.size = len(e.data) if e.kind == tarfile.REGTYPE else 0
            tar.addfile(info, io.BytesIO(e.data) if e.kind == tarfile.REGTYPE else None)
    return out.getvalue()


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def canonical_json(value: object) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


@dataclasses.dataclass
class Image:
    """An image to write: its full name (`registry/repository:tag`), layers (each a list of entries), config."""

    name: str
    layers: list[list[Entry]]
    config: dict
    history: list[str]

    def archive(self, arch: str) -> tuple[bytes, str]:
        """The OCI image layout of this one image, as a tar that `ctr images import` accepts, and the manifest's
        digest (the image's digest in containerd, crictl and a pod's status).

        index.json names the manifest the way containerd's own exporter does: `io.containerd.image.name` is the full
        name (ctr then stores exactly that name, without an `import-<date>` prefix) and
        `org.opencontainers.image.ref.name` the tag, as the OCI image layout suggests.
        """
        blobs: dict[str, bytes] = {}

        def blob(data: bytes) -> dict:
            digest = sha256(data)
            blobs[digest] = data
            return {"digest": digest, "size": len(data)}

        layers, diff_ids = [], []
        for entries in self.layers:
            raw = tar_bytes(entries)
            diff_ids.append(sha256(raw))
            layers.append({"mediaType": MEDIA_LAYER, **blob(gzip.compress(raw, compresslevel=6, mtime=0))})
        config = {
            "architecture": arch,
            "os": "linux",
            "created": "1970-01-01T00:00:00Z",
            "config": self.config,
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
            "history": [{"created": "1970-01-01T00:00:00Z", "created_by": h} for h in self.history],
        }
        manifest = {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": {"mediaType": MEDIA_CONFIG, **blob(canonical_json(config))},
            "layers": layers,
        }
        index = {
            "schemaVersion": 2,
            "mediaType": MEDIA_INDEX,
            "manifests": [
                {
                    "mediaType": MEDIA_MANIFEST,
                    **blob(canonical_json(manifest)),
                    "platform": {"architecture": arch, "os": "linux"},
                    "annotations": {
                        "io.containerd.image.name": self.name,
                        "org.opencontainers.image.ref.name": self.name.rsplit(":", 1)[1],
                    },
                }
            ],
        }
        entries = [
            file("oci-layout", canonical_json({"imageLayoutVersion": "1.0.0"})),
            file("index.json", canonical_json(index)),
        ]
        entries += [file(f"blobs/sha256/{d.removeprefix('sha256:')}", data) for d, data in blobs.items()]
        return tar_bytes(entries), index["manifests"][0]["digest"]


# --- ELF and ldd --------------------------------------------------------------------------------------------------


def elf_interpreter(path: str) -> str | None:
    """The dynamic loader an ELF64 little-endian executable names (PT_INTERP), None when it is static."""
    with open(path, "rb") as f:
        header = f.read(64)
        if header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
            raise BuildError(f"{path} is not a 64-bit little-endian ELF executable")
        phoff, = struct.unpack_from("<Q", header, 32)
        phentsize, phnum = struct.unpack_from("<HH", header, 54)
        for i in range(phnum):
            f.seek(phoff + i * phentsize)
            p_type, _flags, p_offset, _vaddr, _paddr, p_filesz = struct.unpack("<IIQQQQ", f.read(40))
            if p_type == 3:  # PT_INTERP
                f.seek(p_offset)
                return f.read(p_filesz).rstrip(b"\0").decode()
    return None


def linked_libraries(binary: str) -> list[str]:
    """Absolute paths of the shared libraries `ldd` resolves for the binary, the loader included (at its PT_INTERP
    path, where the kernel looks for it). The vDSO has no file and is left out."""
    interpreter = elf_interpreter(binary)
    if interpreter is None:
        return []
    try:
        out = subprocess.run(["ldd", binary], check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise BuildError(f"ldd {binary} failed ({e}); install libc-bin") from e
    paths = {interpreter}
    for line in out.splitlines():
        line = line.strip()
        if "not found" in line:
            raise BuildError(f"{binary} links a library this machine lacks: {line}")
        m = re.match(r"^\S+ => (/\S+) \(", line) or re.match(r"^(/\S+) \(", line)
        if m:
            paths.add(m.group(1))
    return sorted(paths)


# --- the Dockerfile's runtime stage -------------------------------------------------------------------------------


@dataclasses.dataclass
class Instruction:
    line: int
    keyword: str
    args: str


def instructions(text: str) -> list[Instruction]:
    """Dockerfile instructions with continuation lines joined and comment lines dropped, as BuildKit reads them."""
    result, pending, start = [], "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, args = (pending + stripped).strip().partition(" ")
        result.append(Instruction(start, keyword.upper(), args.strip()))
        pending = ""
    if pending:
        raise BuildError(f"Dockerfile line {start}: a continuation line runs past the end of the file")
    return result


@dataclasses.dataclass
class RuntimeStage:
    """What the Dockerfile's last stage makes: its base, config and the files it copies from the build stage."""

    base: str
    user: str = ""
    entrypoint: list[str] = dataclasses.field(default_factory=list)
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    # (destination in the image, file on this machine, mode, the COPY instruction as written)
    copies: list[tuple[str, str, int, str]] = dataclasses.field(default_factory=list)


def substitute(text: str, variables: dict[str, str], where: str) -> str:
    def value(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in variables:
            raise BuildError(f"{where}: ${name} is not an ARG of the runtime stage")
        return variables[name]

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)", value, text)


def installed_files(stage: list[Instruction]) -> dict[str, tuple[str, int]]:
    """Files a build stage's RUN puts in place with `install -m MODE SRC DEST`: DEST → (SRC, mode). SRC is a path of
    the build context (the repository), which is where this builder takes the file from."""
    found = {}
    for ins in stage:
        if ins.keyword == "RUN":
            for m in re.finditer(r"\binstall\s+(?:-D\s+)?-m\s+([0-7]{3,4})\s+(?:-D\s+)?(\S+)\s+(\S+)", ins.args):
                found[m.group(3)] = (m.group(2), int(m.group(1), 8))
    return found


def runtime_stage(dockerfile: str, context: str, build_args: dict[str, str], binary: str | None) -> RuntimeStage:
    """Reads the last stage of the Dockerfile. `binary`, when given, replaces the file a COPY takes from the build
    stage's cargo output (the build stage's `install` names its path in the build context: target/release/gpu-dra);
    the other files a COPY takes (LICENSE, THIRD-PARTY-NOTICES) are read from the build context."""
    try:
        text = pathlib.Path(dockerfile).read_text(encoding="utf-8")
    except OSError as e:
        raise BuildError(f"cannot read the Dockerfile: {e}") from e
    stages: list[tuple[str, list[Instruction]]] = []
    for ins in instructions(text):
        if ins.keyword == "FROM":
            words = ins.args.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else ""
            stages.append((name, []))
        elif not stages:
            if ins.keyword != "ARG":
                raise BuildError(f"{dockerfile}:{ins.line}: {ins.keyword} before the first FROM")
            continue
        stages[-1][1].append(ins)
    if not stages:
        raise BuildError(f"{dockerfile} has no FROM")
    by_name = dict(stages)
    stage = RuntimeStage(base="")
    variables: dict[str, str] = {}
    for ins in stages[-1][1]:
        where = f"{dockerfile}:{ins.line}"
        if ins.keyword not in RUNTIME_INSTRUCTIONS:
            raise BuildError(
                f"{where}: the runtime stage has {ins.keyword}, which e2e/build-images.sh cannot apply without a "
                f"container engine (it knows {', '.join(RUNTIME_INSTRUCTIONS)}); teach e2e/oci_image.py "
                f"(runtime_stage) what {ins.keyword} does, or move it to the build stage"
            )
        if ins.keyword == "FROM":
            stage.base = ins.args.split()[0]
            if stage.base not in STAND_IN_BASES:
                raise BuildError(
                    f"{where}: base image {stage.base} is not one e2e/oci_image.py stands in for "
                    f"({', '.join(STAND_IN_BASES)}); add it to STAND_IN_BASES with what it provides"
                )
        elif ins.keyword == "ARG":
            name, has_default, default = ins.args.partition("=")
            variables[name] = build_args.get(name, default if has_default else "")
        elif ins.keyword == "LABEL":
            for word in shlex.split(substitute(ins.args, variables, where)):
                key, eq, value = word.partition("=")
                if not eq:
                    raise BuildError(f"{where}: LABEL {word!r} is not key=value (the legacy `LABEL key value` form)")
                stage.labels[key] = value
        elif ins.keyword == "USER":
            stage.user = substitute(ins.args, variables, where)
        elif ins.keyword == "ENTRYPOINT":
            try:
                stage.entrypoint = json.loads(ins.args)
            except json.JSONDecodeError:
                stage.entrypoint = None
            if not isinstance(stage.entrypoint, list) or not all(isinstance(a, str) for a in stage.entrypoint):
                raise BuildError(f"{where}: ENTRYPOINT must be the exec form [\"...\"]: the image has no shell")
        elif ins.keyword == "COPY":
            words = ins.args.split()
            flags = [w for w in words if w.startswith("--")]
            paths = [w for w in words if not w.startswith("--")]
            if len(flags) != 1 or not flags[0].startswith("--from=") or len(paths) != 2:
                raise BuildError(f"{where}: only `COPY --from=<stage> SRC DEST` is supported, not COPY {ins.args}")
            from_stage, (src, dest) = flags[0].removeprefix("--from="), paths
            if from_stage not in by_name:
                raise BuildError(f"{where}: COPY --from={from_stage}: no stage of that name")
            made = installed_files(by_name[from_stage])
            if src not in made:
                raise BuildError(
                    f"{where}: the {from_stage} stage puts {src} in place with no `install -m MODE SRC {src}`, "
                    "so e2e/oci_image.py cannot tell which file of the repository it is"
                )
            context_path, mode = made[src]
            # `binary` stands for cargo's output only; the other files (the licenses) are the repository's.
            from_cargo = context_path.startswith("target/release/")
            host = binary if binary and from_cargo else os.path.join(context, context_path)
            stage.copies.append((dest, host, mode, f"COPY {ins.args}"))
    return stage


def gpu_dra_image(name: str, dockerfile: str, context: str, build_args: dict[str, str], binary: str | None) -> Image:
    """The runtime stage as an image: layer 1 stands in for the base (the C runtime every copied executable links,
    from `ldd`, and distroless's users), layer 2 holds the COPY, as `docker build` would lay them out."""
    stage = runtime_stage(dockerfile, context, build_args, binary)
    base: list[Entry] = [
        file("etc/passwd", PASSWD.encode()),
        file("etc/group", GROUP.encode()),
        directory("tmp", 0o1777),
        directory("home/nonroot", 0o700, 65532, 65532),
    ]
    copied: list[Entry] = []
    libraries: set[str] = set()
    for dest, host, mode, _ in stage.copies:
        if not os.path.isfile(host):
            how = {
                "THIRD-PARTY-NOTICES": "write it with e2e/third_party_notices.py",
                "LICENSE": "restore it from git (git checkout LICENSE)",
            }.get(os.path.basename(host), "build it first with `make release` (cargo build --release)")
            raise BuildError(f"{host} does not exist: {how}")
        copied.append(file(dest, pathlib.Path(host).read_bytes(), mode))
        if mode & 0o111:
            libraries.update(linked_libraries(host))
    # At the path the loader and ldd name, with the content of the file behind any symlink (Debian's /lib64 and
    # /lib are links into /usr; here they are plain directories).
    base += [file(path, pathlib.Path(path).read_bytes(), 0o755) for path in sorted(libraries)]
    labels = {k: v for k, v in stage.labels.items() if k != BASE_NAME_LABEL}
    labels[STAND_IN_LABEL] = (
        f"{stage.base} stood in for by the build machine's C runtime ({', '.join(sorted(libraries))}): "
        "no package records; build the Dockerfile with a container engine for the real base"
    )
    config = {"User": stage.user, "Entrypoint": stage.entrypoint, "Env": [DEFAULT_PATH], "Labels": labels}
    history = [f"stand-in for {stage.base}: {' '.join(sorted(libraries))}, /etc/passwd, /etc/group (e2e/oci_image.py)"]
    history += [c[3] for c in stage.copies]
    return Image(name, [base, copied], config, history)


# --- busybox images -----------------------------------------------------------------------------------------------


def busybox_layer(busybox: str) -> list[Entry]:
    """A busybox root file system: /bin/busybox, a symlink for each applet at the path busybox itself lists, and a
    minimal /etc. Pause and workload images share this one layer (same digest, stored once by containerd)."""
    if not os.path.isfile(busybox):
        raise BuildError(f"{busybox} does not exist: install Debian's busybox-static (apt-get install busybox-static)")
    if elf_interpreter(busybox) is not None:
        raise BuildError(f"{busybox} is dynamically linked and the image has no C library: use busybox-static's")
    try:
        applets = subprocess.run([busybox, "--list-full"], check=True, capture_output=True, text=True).stdout.split()
    except (OSError, subprocess.CalledProcessError) as e:
        raise BuildError(f"{busybox} --list-full failed ({e}): is it busybox?") from e
    entries = [file("bin/busybox", pathlib.Path(busybox).read_bytes(), 0o755)]
    entries += [symlink(a, "/bin/busybox") for a in applets if a.strip("/") != "bin/busybox"]
    entries += [file("etc/passwd", BUSYBOX_PASSWD.encode()), file("etc/group", BUSYBOX_GROUP.encode())]
    entries += [directory(d) for d in ("proc", "sys", "dev", "etc")]
    entries += [directory("tmp", 0o1777), directory("root", 0o700)]
    return entries


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--dockerfile", required=True)
    parser.add_argument("--context", required=True, help="the build context: the repository root")
    parser.add_argument("--binary", help="instead of the file the Dockerfile copies from the build stage")
    parser.add_argument("--busybox", required=True)
    parser.add_argument("--build-arg", action="append", default=[], help="NAME=VALUE, as docker build takes it")
    parser.add_argument("--gpu-dra-name", required=True)
    parser.add_argument("--pause-name", required=True)
    parser.add_argument("--workload-name", required=True)
    args = parser.parse_args()
    arch = GOARCH.get(os.uname().machine)
    if arch is None:
        raise BuildError(f"no OCI architecture known for {os.uname().machine}; add it to GOARCH")
    build_args = dict(a.partition("=")[::2] for a in args.build_arg)
    rootfs = busybox_layer(args.busybox)
    images = {
        "pause.tar": Image(args.pause_name, [rootfs], {"Entrypoint": PAUSE_ENTRYPOINT, "Env": [DEFAULT_PATH]},
                           ["busybox root file system (e2e/oci_image.py)"]),
        "workload.tar": Image(args.workload_name, [rootfs], {"Cmd": ["sh"], "Env": [DEFAULT_PATH]},
                              ["busybox root file system (e2e/oci_image.py)"]),
        "gpu-dra.tar": gpu_dra_image(args.gpu_dra_name, args.dockerfile, args.context, build_args, args.binary),
    }
    os.makedirs(args.out, exist_ok=True)
    for filename, image in images.items():
        data, digest = image.archive(arch)
        path = os.path.join(args.out, filename)
        with open(path + ".tmp", "wb") as f:
            f.write(data)
        os.replace(path + ".tmp", path)
        print(f"{filename} {image.name} {digest} {len(data)}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BuildError as e:
        print(f"[build-images] error: {e}", file=sys.stderr)
        sys.exit(1)
