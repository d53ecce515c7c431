# syntax=docker/dockerfile:1
# The gpu-dra image: one binary, `gpu-dra controller` and `gpu-dra node-agent` (see charts/gpu-dra).
#
#   docker build -t gpu-dra:dev .
#   docker build --build-arg VERSION=0.1.0 --build-arg REVISION="$(git rev-parse HEAD)" -t gpu-dra:0.1.0 .

# --- build ------------------------------------------------------------------------------------------------------
# The compiler rust-toolchain.toml pins (1.95.0), so rustup has nothing to download. The .proto files compile with
# protox (pure Rust): no protoc needed.
FROM rust:1.95.0-bookworm AS build
# The context leaves .git out: the commit `gpu-dra --version` and gpu_dra_build_info report comes from here.
ARG REVISION=unknown
ENV GPU_DRA_BUILD_COMMIT=$REVISION
WORKDIR /src
COPY . .
# The same command CI's toolchain runs, with the lock file as is. The caches speed up rebuilds; the binary is copied
# out of the target cache within the same step. The licenses travel with it: gpu-dra's, and the notices of the
# crates built into it (e2e/third_party_notices.py writes that file from Cargo.lock; make lint checks it).
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    --mount=type=cache,target=/src/target,sharing=locked \
    cargo build --release --locked \
    && install -D -m 0755 target/release/gpu-dra /out/gpu-dra \
    && install -D -m 0644 LICENSE /out/LICENSE \
    && install -D -m 0644 THIRD-PARTY-NOTICES /out/THIRD-PARTY-NOTICES

# --- run --------------------------------------------------------------------------------------------------------
# glibc and libgcc only (distroless/cc): the binary is dynamically linked against glibc, and NVML
# (libnvidia-ml.so.1) is dlopen'ed at run time from the node's driver root, so no NVIDIA library is in the image.
# No shell, no package manager.
FROM gcr.io/distroless/cc-debian12:nonroot
ARG VERSION=0.1.0
ARG REVISION=unknown
LABEL org.opencontainers.image.title="gpu-dra" \
      org.opencontainers.image.description="Kubernetes Dynamic Resource Allocation for NVIDIA GPUs: ResourceClaim controller and node agent (DRA kubelet plugin)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="gcr.io/distroless/cc-debian12:nonroot"
COPY --from=build /out/gpu-dra /gpu-dra
COPY --from=build /out/LICENSE /usr/share/doc/gpu-dra/LICENSE
COPY --from=build /out/THIRD-PARTY-NOTICES /usr/share/doc/gpu-dra/THIRD-PARTY-NOTICES
# Non-root by default (uid 65532, `nonroot`): right for the controller. The node agent's DaemonSet runs it as root
# (runAsUser 0 in the chart) because it creates sockets in the kubelet's root-owned plugin directories and writes
# the CDI and state directories on the host.
USER 65532:65532
ENTRYPOINT ["/gpu-dra"]
