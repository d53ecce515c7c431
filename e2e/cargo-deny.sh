#!/usr/bin/env bash
# Checks the dependency tree against deny.toml with cargo-deny: licenses (an allow-list), bans (duplicate versions
# warn) and sources (crates.io only). Offline: cargo metadata reads the local registry cache, and the advisories
# check is NOT run, because its database is fetched from the network, which this machine and CI do not have.
# cargo-deny comes from crates.io (pinned in versions.sh), built once into the cache (`cargo install --locked`, at
# opt-level 1 without LTO instead of the crate's fat-LTO release profile: a lint tool that checks one dependency tree in
# about a second need not be the fastest, and on a cold two-core CI machine its build time is on the critical path).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=e2e/versions.sh
source "$root/e2e/versions.sh"
die() { printf '[cargo-deny] error: %s\n' "$*" >&2; exit 1; }

deny=$CARGO_DENY_DIR/bin/cargo-deny
if [[ ! -x "$deny" ]]; then
    command -v cargo >/dev/null 2>&1 || die "cargo is needed to install cargo-deny from crates.io"
    printf '[cargo-deny] installing cargo-deny %s into %s (once)\n' "$CARGO_DENY_VERSION" "$CARGO_DENY_DIR" >&2
    rm -rf "$CARGO_DENY_DIR"
    started=$SECONDS
    # In the repository: the toolchain rust-toolchain.toml pins builds it, the one every machine here has.
    (cd "$root" && CARGO_PROFILE_RELEASE_LTO=false CARGO_PROFILE_RELEASE_CODEGEN_UNITS=16 CARGO_PROFILE_RELEASE_OPT_LEVEL=1 \
        cargo install --locked --quiet --root "$CARGO_DENY_DIR" "cargo-deny@$CARGO_DENY_VERSION") ||
        die "cargo install cargo-deny@$CARGO_DENY_VERSION failed; check access to crates.io"
    printf '[cargo-deny] installed in %ss\n' "$((SECONDS - started))" >&2
fi
"$deny" --manifest-path "$root/Cargo.toml" --config "$root/deny.toml" --frozen check \
    --hide-inclusion-graph licenses bans sources
echo "[cargo-deny] licenses, bans, sources: ok (advisories not checked: no network for the advisory database)" >&2
