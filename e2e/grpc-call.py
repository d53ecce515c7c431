"""One unary gRPC call with grpc-python, for tests that check that the plugin's sockets answer every gRPC client.

Usage: python grpc-call.py TARGET METHOD < request.bin > response.bin

TARGET is a gRPC target (`unix:/path/to.sock`, `unix:///path/to.sock`); METHOD the full method name
(`/v1.DRAPlugin/NodePrepareResources`). The request's serialized protobuf message is read from stdin and the
response's written to stdout, so no generated code is needed. A failed call prints its status code and details
on stderr and exits with 1.
"""

import sys

import grpc


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    target, method = sys.argv[1], sys.argv[2]
    request = sys.stdin.buffer.read()
    with grpc.insecure_channel(target) as channel:
        # No serializers: the call sends and returns bytes as they are.
        call = channel.unary_unary(method)
        try:
            response = call(request, timeout=10)
        except grpc.RpcError as error:
            print(f"{error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    sys.stdout.buffer.write(response)
    return 0


if __name__ == "__main__":
    sys.exit(main())
