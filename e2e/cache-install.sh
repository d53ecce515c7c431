# Installing Go binaries into the cache (build-k8s.sh, build-node.sh source this).
#
# A cached binary is trusted by the next run as soon as it exists and is executable, so it must appear whole or
# not at all: a build killed half-way (a CI job stopped) must not leave a truncated one. `go install` renames its
# output into GOBIN only when both are on one filesystem and copies it in place otherwise (and always for an
# executable it had cached), so it installs into a fresh directory beside the cache entry, and each binary is then
# renamed into place.

# go_install_into DEST WORKDIR GO_INSTALL_ARGS...: `go install` through the caller's go_in (run in WORKDIR), the
# binaries ending up in DEST. Environment given before the call (CGO_ENABLED=0 ...) reaches go.
go_install_into() {
    local dest=$1 dir=$2 staging b
    shift 2
    mkdir -p "$dest"
    staging=$(mktemp -d "$dest/.installing.XXXXXX")
    GOBIN="$staging" go_in "$dir" install "$@"
    for b in "$staging"/*; do mv -f "$b" "$dest/"; done
    rmdir "$staging"
}
