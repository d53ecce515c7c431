#!/usr/bin/env bash
# Builds the images a real node runs, as OCI image-layout archives for `ctr -n k8s.io images import FILE`, without a
# container engine or a registry:
#
#   OUTDIR/pause.tar     registry.k8s.io/pause:3.10.2  the pod sandbox image containerd v2.4.2 and kubeadm v1.37.2
#                                                      default to (a busybox that waits for TERM and exits 0)
#   OUTDIR/workload.tar  docker.io/library/busybox:gpu-dra-e2e  busybox with /bin/sh and every applet, for test pods
#                                                      (`image: busybox:gpu-dra-e2e` normalizes to this name)
#   OUTDIR/gpu-dra.tar   <chart image.repository>:<chart appVersion>  the Dockerfile's runtime stage around
#                                                      target/release/gpu-dra; `helm install` with default values
#                                                      uses it
#
# The archives are deterministic (same inputs, same digests). Prints one line per archive:
#   FILE NAME MANIFEST-DIGEST BYTES
#
# Usage: e2e/build-images.sh [--binary PATH] [--busybox PATH] [--dockerfile PATH] [--tag TAG] OUTDIR
#   --binary      the gpu-dra executable (default: what `make release` builds, target/release/gpu-dra, or
#                 $CARGO_TARGET_DIR/release/gpu-dra when that is set)
#   --busybox     a static busybox (default /usr/bin/busybox, from Debian's busybox-static)
#   --dockerfile  the Dockerfile whose runtime stage the gpu-dra image is (default: the repository's)
#   --tag         the gpu-dra image's tag (default: the chart's appVersion, which the chart deploys by default)
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
die() { printf '[build-images] error: %s\n' "$*" >&2; exit 1; }
usage() { sed -n '/^# Usage:/,/^set /p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2; exit 2; }

binary='' busybox=/usr/bin/busybox dockerfile="$repo/Dockerfile" tag='' out=''
while [[ $# -gt 0 ]]; do
    case $1 in
        --binary) binary=${2:?--binary needs a path}; shift 2 ;;
        --busybox) busybox=${2:?--busybox needs a path}; shift 2 ;;
        --dockerfile) dockerfile=${2:?--dockerfile needs a path}; shift 2 ;;
        --tag) tag=${2:?--tag needs a value}; shift 2 ;;
        -h|--help) usage ;;
        -*) printf '[build-images] unknown option %s\n' "$1" >&2; usage ;;
        *) [[ -z $out ]] || usage; out=$1; shift ;;
    esac
done
[[ -n $out ]] || usage
[[ -n $binary || -z ${CARGO_TARGET_DIR:-} ]] || binary=$CARGO_TARGET_DIR/release/gpu-dra

command -v python3 >/dev/null || die "python3 is needed (apt-get install python3)"
[[ -x $busybox ]] ||
    die "no busybox at $busybox: install Debian's busybox-static or pass --busybox PATH"

# The chart's image: image.repository from values.yaml, the tag the chart defaults to (its appVersion).
repository=$(awk '/^image:/ {in_image = 1; next} /^[^ #]/ {in_image = 0}
    in_image && $1 == "repository:" {print $2; exit}' "$repo/charts/gpu-dra/values.yaml")
[[ -n $repository ]] || die "no image.repository in charts/gpu-dra/values.yaml"
if [[ -z $tag ]]; then
    tag=$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' "$repo/charts/gpu-dra/Chart.yaml")
    [[ -n $tag ]] || die "no appVersion in charts/gpu-dra/Chart.yaml: pass --tag"
fi
# The build arguments a release build passes (see the Dockerfile's header).
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$repo/Cargo.toml" | head -n 1)
[[ -n $version ]] || die "no package version in Cargo.toml"
revision=$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)

exec python3 "$repo/e2e/oci_image.py" --out "$out" --dockerfile "$dockerfile" --context "$repo" \
    ${binary:+--binary "$binary"} --busybox "$busybox" \
    --build-arg "VERSION=$version" --build-arg "REVISION=$revision" \
    --gpu-dra-name "$repository:$tag" \
    --pause-name registry.k8s.io/pause:3.10.2 \
    --workload-name docker.io/library/busybox:gpu-dra-e2e
