# Certificates and kubeconfigs of the local cluster, shared by e2e/cluster.sh (the control plane) and e2e/node.sh
# (a real node's kubelet and kube-proxy). Sourced, not run.

# pki_issue DIR NAME SUBJECT [SAN]: a P-256 key and certificate NAME.{key,crt} in DIR signed by DIR/ca.{crt,key};
# a server certificate when SAN is given, a client certificate otherwise.
pki_issue() {
    local dir=$1 name=$2 subject=$3 san=${4:-}
    (
        cd "$dir"
        openssl ecparam -name prime256v1 -genkey -noout -out "$name.key" 2>/dev/null
        openssl req -new -key "$name.key" -subj "$subject" -out "$name.csr" 2>/dev/null
        if [[ -n "$san" ]]; then
            printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\n' "$san" >"$name.ext"
        else
            printf 'extendedKeyUsage=clientAuth\n' >"$name.ext"
        fi
        openssl x509 -req -in "$name.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
            -extfile "$name.ext" -out "$name.crt" 2>/dev/null
        rm -f "$name.csr" "$name.ext"
    )
}

# pki_kubeconfig FILE SERVER CA_CRT USER CRT KEY: a kubeconfig with one client-certificate user, mode 600.
pki_kubeconfig() {
    local b64='base64 -w0'
    cat >"$1" <<KC
apiVersion: v1
kind: Config
clusters:
- name: gpu-dra-e2e
  cluster:
    server: $2
    certificate-authority-data: $($b64 <"$3")
users:
- name: $4
  user:
    client-certificate-data: $($b64 <"$5")
    client-key-data: $($b64 <"$6")
contexts:
- name: gpu-dra-e2e
  context: {cluster: gpu-dra-e2e, user: $4}
current-context: gpu-dra-e2e
KC
    chmod 600 "$1"
}
