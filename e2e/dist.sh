#!/usr/bin/env bash
# Builds the release artifacts of this source tree into dist/ (emptied first), all named with Cargo.toml's version:
#
#   dist/gpu-dra-VERSION-linux-ARCH   the release binary (target/release/gpu-dra, as `make release` builds it)
#   dist/gpu-dra-VERSION.tgz          the Helm chart, packaged (`helm install gpu-dra dist/gpu-dra-VERSION.tgz`)
#   dist/gpu-dra-image-VERSION.tar    the gpu-dra OCI image archive (e2e/build-images.sh), tagged
#                                     <image.repository>:VERSION as the chart deploys it by default
#                                     (`ctr -n k8s.io images import`, `skopeo copy oci-archive:…`)
#   dist/LICENSE                      gpu-dra's license (Apache-2.0)
#   dist/THIRD-PARTY-NOTICES          the licenses of the crates built into the binary (e2e/third_party_notices.py)
#   dist/SHA256SUMS                   `cd dist && sha256sum -c SHA256SUMS`
#
# Usage: e2e/dist.sh   (`make dist` builds the binary and helm first)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
die() { printf '[dist] error: %s\n' "$*" >&2; exit 1; }

version=$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/Cargo.toml" | head -n 1)
[[ -n $version ]] || die "no package version in Cargo.toml"
binary=${CARGO_TARGET_DIR:-$root/target}/release/gpu-dra
[[ -x $binary ]] || die "no $binary: run make release"
helm=$("$root/e2e/build-k8s.sh" --print-bin-dirs | sed -n 3p)/helm
[[ -x $helm ]] || die "no helm at $helm: run e2e/build-k8s.sh"
case $(uname -m) in
    x86_64) arch=amd64 ;;
    aarch64) arch=arm64 ;;
    *) arch=$(uname -m) ;;
esac

out=$root/dist
rm -rf "$out"
mkdir -p "$out"
install -m 0755 "$binary" "$out/gpu-dra-$version-linux-$arch"
"$helm" package "$root/charts/gpu-dra" --destination "$out" >/dev/null
[[ -f $out/gpu-dra-$version.tgz ]] ||
    die "helm package wrote $(ls "$out"), not gpu-dra-$version.tgz: set the chart's version to Cargo.toml's"
images=$(mktemp -d)
trap 'rm -rf "$images"' EXIT
"$root/e2e/build-images.sh" --binary "$binary" "$images" >/dev/null
mv "$images/gpu-dra.tar" "$out/gpu-dra-image-$version.tar"
install -m 0644 "$root/LICENSE" "$root/THIRD-PARTY-NOTICES" "$out/"
(cd "$out" && sha256sum -- gpu-dra-* LICENSE THIRD-PARTY-NOTICES >SHA256SUMS)
printf '[dist] %s\n' "$(cd "$out" && ls -l --block-size=K -- *)" >&2
