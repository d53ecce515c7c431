package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// grpcCall is `gpu-dra-kubelet-harness grpc-call`: one unary call with grpc-go, the request's serialized protobuf
// message read from stdin and the response's written to stdout (no generated code needed). Tests use it to check
// that a plugin's sockets answer grpc-go however it dials them:
//
//   - `--target unix:///abs/path` or `--target unix:rel/path`: grpc-go's unix resolver (authority `localhost`),
//     as the kubelet's DRA manager dials a plugin (pkg/kubelet/cm/dra/plugin/dra_plugin_manager.go);
//   - `--target /abs/path --unix-dialer`: passthrough with a custom dialer (authority: the percent-encoded path),
//     as the kubelet's plugin watcher dials a registration socket (pluginmanager/operationexecutor);
//   - `--authority X`: X as `:authority`, e.g. a raw socket path as grpc-java sends.
func grpcCall(args []string) error {
	fs := flag.NewFlagSet("grpc-call", flag.ContinueOnError)
	target := fs.String("target", "", "gRPC target, or with --unix-dialer a unix socket path (required)")
	unixDialer := fs.Bool("unix-dialer", false, "dial --target as a socket path through a custom dialer (passthrough)")
	authority := fs.String("authority", "", "send this :authority instead of grpc-go's default")
	method := fs.String("method", "", "full method name, e.g. /pluginregistration.Registration/GetInfo (required)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *target == "" || *method == "" {
		return fmt.Errorf("grpc-call: --target and --method are required")
	}
	options := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	if *unixDialer {
		options = append(options, grpc.WithContextDialer(func(ctx context.Context, path string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", path)
		}))
		*target = "passthrough:///" + *target
	}
	if *authority != "" {
		options = append(options, grpc.WithAuthority(*authority))
	}
	request, err := io.ReadAll(os.Stdin)
	if err != nil {
		return fmt.Errorf("read the request from stdin: %w", err)
	}
	conn, err := grpc.NewClient(*target, options...)
	if err != nil {
		return fmt.Errorf("create the client for %s: %w", *target, err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var response []byte
	if err := conn.Invoke(ctx, *method, &request, &response, grpc.ForceCodec(rawCodec{})); err != nil {
		return fmt.Errorf("%s on %s: %w", *method, *target, err)
	}
	_, err = os.Stdout.Write(response)
	return err
}

// rawCodec passes messages through as bytes: the caller serializes them.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) {
	b, ok := v.(*[]byte)
	if !ok {
		return nil, fmt.Errorf("rawCodec: cannot marshal %T", v)
	}
	return *b, nil
}

func (rawCodec) Unmarshal(data []byte, v any) error {
	b, ok := v.(*[]byte)
	if !ok {
		return fmt.Errorf("rawCodec: cannot unmarshal into %T", v)
	}
	*b = append((*b)[:0], data...)
	return nil
}

// Name is the content subtype grpc-go sends (`application/grpc+proto`): what the bytes are.
func (rawCodec) Name() string { return "proto" }
