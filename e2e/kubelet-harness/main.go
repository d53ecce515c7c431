// Command gpu-dra-kubelet-harness is "the kubelet side" of one fake node for gpu-dra's end-to-end tests.
//
// It runs the real kubelet DRA code from k8s.io/kubernetes, not a re-implementation: the plugin manager
// (pkg/kubelet/pluginmanager) watches the plugin registry directory and registers DRA drivers with the DRA
// manager (pkg/kubelet/cm/dra), which calls the drivers' NodePrepareResources / NodeUnprepareResources and
// keeps its own checkpoint, exactly as in a kubelet. What a kubelet does around it (pod workers, the
// container runtime, the status manager) is reduced to what the tests observe:
//
//   - a pod bound to the node and not finished gets PrepareResources (retried with back-off, as the pod
//     worker retries a failed sync), then the status a running pod would have;
//   - a pod that does not restart its containers (restartPolicy Never or OnFailure, a Job's pod) and carries the
//     annotation e2e.gpu-dra.dev/run-for (a Go duration) gets the status of a pod whose containers exited 0 that
//     long after it started: phase Succeeded;
//   - a pod that is deleted, finished (phase Succeeded/Failed) or terminating gets UnprepareResources;
//   - a terminating pod is then deleted for good (grace period 0, UID precondition), as the kubelet's status
//     manager does once its containers stopped; "deleted" says the node is done with a pod, also one that a
//     grace-period-0 delete removed before the harness saw it terminating.
//
// Every observable step is one JSON line on stdout; logs go to stderr or --log-file.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"sync"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	toolscache "k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"
	pluginwatcherapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
	"k8s.io/kubernetes/pkg/features"
	"k8s.io/kubernetes/pkg/kubelet/cm/dra"
	"k8s.io/kubernetes/pkg/kubelet/config"
	"k8s.io/kubernetes/pkg/kubelet/pluginmanager"
	plugincache "k8s.io/kubernetes/pkg/kubelet/pluginmanager/cache"
	"k8s.io/utils/ptr"
)

// defaultWorkers is how many pods are synced in parallel unless --workers says otherwise. The kubelet has one
// worker per pod; a few are enough for tests, and more than one keeps a slow or stuck driver call for one pod from
// holding up the others. Benchmarks of many pods starting at once ask for one per pod, as a kubelet has.
const defaultWorkers = 4

// runForAnnotation makes a pod's containers "exit 0" that long after the pod started (see runFor).
const runForAnnotation = "e2e.gpu-dra.dev/run-for"

func main() {
	if len(os.Args) > 1 && os.Args[1] == "read-device-metadata" {
		if err := readDeviceMetadata(os.Args[2:]); err != nil {
			fmt.Fprintf(os.Stderr, "gpu-dra-kubelet-harness: %v\n", err)
			os.Exit(1)
		}
		return
	}
	if len(os.Args) > 1 && os.Args[1] == "grpc-call" {
		if err := grpcCall(os.Args[2:]); err != nil {
			fmt.Fprintf(os.Stderr, "gpu-dra-kubelet-harness: %v\n", err)
			os.Exit(1)
		}
		return
	}
	kubeconfig := flag.String("kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig of the cluster (default $KUBECONFIG)")
	nodeName := flag.String("node-name", "", "the node this harness plays the kubelet for (required)")
	registryDir := flag.String("registry-dir", "", "plugin registration directory to watch, the kubelet's plugins_registry (required)")
	stateDir := flag.String("state-dir", "", "directory for the DRA manager's checkpoint (required)")
	logFile := flag.String("log-file", "", "write logs to this file instead of stderr")
	verbosity := flag.Int("v", 2, "log verbosity (klog)")
	featureGates := flag.String("feature-gates", "", "kubelet feature gates, e.g. ResourceHealthStatus=false (optional)")
	workers := flag.Int("workers", defaultWorkers, "pods synced in parallel (the kubelet: one per pod)")
	flag.Parse()
	if *workers < 1 {
		fmt.Fprintf(os.Stderr, "gpu-dra-kubelet-harness: --workers=%d: at least one worker is needed\n", *workers)
		os.Exit(2)
	}
	if *nodeName == "" || *registryDir == "" || *stateDir == "" || *kubeconfig == "" {
		fmt.Fprintln(os.Stderr, "gpu-dra-kubelet-harness: --kubeconfig (or $KUBECONFIG), --node-name, --registry-dir and --state-dir are required")
		flag.Usage()
		os.Exit(2)
	}
	if err := setUpLogging(*logFile, *verbosity); err != nil {
		fatal(err)
	}
	if *featureGates != "" {
		if err := utilfeature.DefaultMutableFeatureGate.Set(*featureGates); err != nil {
			fatal(fmt.Errorf("--feature-gates: %w", err))
		}
	}

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	ctx = klog.NewContext(ctx, klog.Background().WithValues("node", *nodeName))
	if err := run(ctx, *kubeconfig, *nodeName, *registryDir, *stateDir, *workers); err != nil {
		fatal(err)
	}
	klog.Flush()
}

func fatal(err error) {
	klog.Flush()
	fmt.Fprintf(os.Stderr, "gpu-dra-kubelet-harness: %v\n", err)
	os.Exit(1)
}

// setUpLogging points klog at a file or stderr; stdout is reserved for the JSON events.
func setUpLogging(logFile string, verbosity int) error {
	fs := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(fs)
	settings := map[string]string{"v": fmt.Sprint(verbosity)}
	if logFile != "" {
		settings["logtostderr"] = "false"
		settings["log_file"] = logFile
		settings["stderrthreshold"] = "FATAL"
	}
	for name, value := range settings {
		if err := fs.Set(name, value); err != nil {
			return fmt.Errorf("klog flag %s: %w", name, err)
		}
	}
	return nil
}

func run(ctx context.Context, kubeconfig, nodeName, registryDir, stateDir string, workers int) error {
	logger := klog.FromContext(ctx)
	restConfig, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return fmt.Errorf("kubeconfig %s: %w", kubeconfig, err)
	}
	restConfig.UserAgent = "gpu-dra-kubelet-harness/" + nodeName
	// The kubelet's client limits (KubeletConfiguration kubeAPIQPS 50, kubeAPIBurst 100: pkg/kubelet/apis/config/
	// v1beta1/defaults.go), not client-go's 5/10: with those, pods started together would wait for their claim reads
	// in the harness, not in the DRA path a real kubelet runs.
	restConfig.QPS = 50
	restConfig.Burst = 100
	client, err := kubernetes.NewForConfig(restConfig)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(stateDir, 0o750); err != nil {
		return err
	}

	// Only the pods bound to this node, as the kubelet's API pod source watches them.
	factory := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", nodeName).String()
	}))
	podInformer := factory.Core().V1().Pods().Informer()

	h := &harness{
		client:  client,
		pods:    podInformer.GetIndexer(),
		started: map[string]*startedPod{},
		// The kubelet's pod workers retry a failed sync after a back-off; a shorter one suits tests.
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.NewTypedItemExponentialFailureRateLimiter[string](500*time.Millisecond, 10*time.Second),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "pods"}),
	}
	enqueue := func(obj any) {
		if key, err := toolscache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
			h.queue.Add(key)
		}
	}
	if _, err := podInformer.AddEventHandler(toolscache.ResourceEventHandlerFuncs{
		AddFunc:    enqueue,
		UpdateFunc: func(_, obj any) { enqueue(obj) },
		DeleteFunc: enqueue,
	}); err != nil {
		return err
	}

	// The DRA manager as the kubelet's container manager creates and starts it (cm/container_manager_linux.go).
	// The kubelet passes its root directory as the state directory.
	h.dra, err = dra.NewManager(logger, client, stateDir)
	if err != nil {
		return fmt.Errorf("DRA manager: %w", err)
	}
	// The manager's reconcile loop unprepares claims of pods that are no longer active, once all pod sources
	// were seen; here the only source is the pod informer.
	sourcesReady := config.NewSourcesReady(func(sets.Set[string]) bool { return podInformer.HasSynced() })
	getNode := nodeGetter(ctx, client, nodeName)
	// Start creates the DRA plugin manager, which at once wipes this node's ResourceSlices in the background,
	// as a starting kubelet does, and later wipes a driver's slices when its plugin stays unregistered.
	if err := h.dra.Start(ctx, h.activePods, getNode, sourcesReady); err != nil {
		return fmt.Errorf("start DRA manager: %w", err)
	}
	defer stopManager(h.dra)

	// The plugin manager as kubelet.go creates and runs it, with the DRA manager's handler for "DRAPlugin"
	// (GetWatcherHandler must be called after Start). Its event recorder is kept but never used in v1.37.
	plugins := pluginmanager.NewPluginManager(registryDir, &record.FakeRecorder{})
	plugins.AddHandler(pluginwatcherapi.DRAPlugin, reportingHandler{h.dra.GetWatcherHandler()})
	var wg sync.WaitGroup
	wg.Go(func() { runPluginManager(ctx, plugins, sourcesReady) })

	factory.Start(ctx.Done())
	if !toolscache.WaitForCacheSync(ctx.Done(), podInformer.HasSynced) {
		return errors.New("stopped before the pod informer synced")
	}
	for range workers {
		wg.Go(func() {
			for h.processNext(ctx) {
			}
		})
	}
	// The kubelet's sync loop syncs again the pods a device health change concerns (kubelet.go, the container
	// manager's Updates()), which writes their allocatedResourcesStatus anew.
	wg.Go(func() {
		for {
			select {
			case <-ctx.Done():
				return
			case update := <-h.dra.Updates():
				for _, uid := range update.PodUIDs {
					h.healthChanged(types.UID(uid))
				}
			}
		}
	})
	emit(event{Event: "ready", Node: nodeName})

	<-ctx.Done()
	logger.Info("Shutting down")
	h.queue.ShutDown()
	factory.Shutdown()
	wg.Wait()
	return nil
}

// reportingHandler is the DRA manager's plugin handler; it also reports (de)registrations on stdout. Its
// RegisterPlugin and DeRegisterPlugin, whose signatures changed in 1.37, are in the compat_*.go files.
type reportingHandler struct{ plugincache.PluginHandler }

// registered reports the outcome err of a registration and returns it.
func (r reportingHandler) registered(name, endpoint string, err error) error {
	if err == nil {
		emit(event{Event: "registered", Driver: name, Endpoint: endpoint})
	} else {
		emit(event{Event: "registration-failed", Driver: name, Endpoint: endpoint, Error: err.Error()})
	}
	return err
}

func (r reportingHandler) deregistered(name, endpoint string) {
	emit(event{Event: "deregistered", Driver: name, Endpoint: endpoint})
}

type harness struct {
	client kubernetes.Interface
	dra    *dra.Manager
	pods   toolscache.Indexer
	queue  workqueue.TypedRateLimitingInterface[string]

	mu sync.Mutex
	// started holds, per pod key (namespace/name), the pod whose resources this harness began to prepare.
	// Its object is what UnprepareResources needs once the pod is gone from the API.
	started map[string]*startedPod
}

type startedPod struct {
	pod      *v1.Pod
	prepared bool // PrepareResources succeeded
	reported bool // its status was written and the "prepared" event printed
	// healthStale: the health of its devices changed since its status was written (guarded by harness.mu).
	healthStale bool
}

// healthChanged marks the started pod with UID uid for a status rewrite and queues it.
func (h *harness) healthChanged(uid types.UID) {
	for _, obj := range h.pods.List() {
		pod := obj.(*v1.Pod)
		if pod.UID != uid {
			continue
		}
		key, err := toolscache.MetaNamespaceKeyFunc(pod)
		if err != nil {
			return
		}
		h.mu.Lock()
		if p := h.started[key]; p != nil && p.pod.UID == uid {
			p.healthStale = true
		}
		h.mu.Unlock()
		h.queue.Add(key)
		return
	}
}

// deviceHealthInto fills in the health of pod's allocated DRA devices (allocatedResourcesStatus), as the kubelet
// does only with its feature gate ResourceHealthStatus on (kubelet_pods.go; off by default before 1.36).
func (h *harness) deviceHealthInto(ctx context.Context, pod *v1.Pod, status *v1.PodStatus) {
	if utilfeature.DefaultFeatureGate.Enabled(features.ResourceHealthStatus) {
		updateAllocatedResourcesStatus(ctx, h.dra, pod, status)
	}
}

// refreshHealth writes pod's allocatedResourcesStatus anew, as the kubelet's status manager does on a resync.
func (h *harness) refreshHealth(ctx context.Context, pod *v1.Pod) error {
	p := pod.DeepCopy()
	h.deviceHealthInto(ctx, pod, &p.Status)
	_, err := h.client.CoreV1().Pods(p.Namespace).UpdateStatus(ctx, p, metav1.UpdateOptions{})
	return err
}

// activePods is the kubelet's notion for the DRA manager's reconcile loop: pods on the node that still run.
func (h *harness) activePods() []*v1.Pod {
	var active []*v1.Pod
	for _, obj := range h.pods.List() {
		if pod := obj.(*v1.Pod); !finished(pod) {
			active = append(active, pod)
		}
	}
	return active
}

// finished: the kubelet stops a pod's containers, and then unprepares its claims, when the pod is being
// deleted or has reached a terminal phase.
func finished(pod *v1.Pod) bool {
	return pod.DeletionTimestamp != nil || pod.Status.Phase == v1.PodSucceeded || pod.Status.Phase == v1.PodFailed
}

func (h *harness) processNext(ctx context.Context) bool {
	key, quit := h.queue.Get()
	if quit {
		return false
	}
	defer h.queue.Done(key)
	if err := h.sync(ctx, key); err != nil {
		if ctx.Err() == nil {
			klog.FromContext(ctx).Info("Pod sync failed, will retry", "pod", key, "err", err)
			h.queue.AddRateLimited(key)
		}
		return true
	}
	h.queue.Forget(key)
	return true
}

// sync brings one pod's DRA resources in line with its state, like the kubelet's pod worker.
// The work queue never syncs the same key concurrently.
func (h *harness) sync(ctx context.Context, key string) error {
	var pod *v1.Pod
	if obj, exists, err := h.pods.GetByKey(key); err != nil {
		return err
	} else if exists {
		pod = obj.(*v1.Pod)
	}

	h.mu.Lock()
	prev := h.started[key]
	h.mu.Unlock()

	// A pod we started that is gone, replaced by a namesake or finished: unprepare it. Like the kubelet, also
	// after a failed prepare, which may have left claims half-prepared.
	if prev != nil && (pod == nil || pod.UID != prev.pod.UID || finished(pod)) {
		if err := h.unprepare(ctx, key, prev); err != nil {
			return err
		}
		if pod == nil {
			// Deleted for good before this sync saw it terminating (grace period 0: the terminating update
			// and the removal come one right after the other): the node is done with it all the same.
			emit(event{Event: "deleted", Pod: key})
			return nil
		}
		prev = nil
	}
	if pod == nil {
		return nil
	}
	if finished(pod) {
		// It may have been prepared before this harness (re)started: the manager's checkpoint knows.
		if h.dra.PodMightNeedToUnprepareResources(pod.UID) {
			if err := h.unprepare(ctx, key, &startedPod{pod: pod}); err != nil {
				return err
			}
		}
		if pod.DeletionTimestamp != nil {
			return h.finishDeletion(ctx, key, pod)
		}
		return nil
	}
	if prev == nil {
		prev = &startedPod{pod: pod}
		h.mu.Lock()
		h.started[key] = prev
		h.mu.Unlock()
	}
	if prev.reported {
		h.mu.Lock()
		stale := prev.healthStale
		prev.healthStale = false
		h.mu.Unlock()
		if stale && !finished(pod) {
			if err := h.refreshHealth(ctx, pod); err != nil {
				h.mu.Lock()
				prev.healthStale = true
				h.mu.Unlock()
				return fmt.Errorf("update device health in pod status: %w", err)
			}
		}
		return h.finishIfDone(ctx, key, pod)
	}

	// How long the DRA manager took to prepare, in this sync (0: prepared in an earlier one).
	var prepareMs float64
	if !prev.prepared {
		// Idempotent: claims that the manager's checkpoint has as prepared are not prepared again.
		began := time.Now()
		if err := h.dra.PrepareResources(ctx, pod); err != nil {
			emit(event{Event: "prepare-failed", Pod: key, Error: err.Error()})
			return err
		}
		prepareMs = float64(time.Since(began).Microseconds()) / 1000
		prev.prepared = true
	}

	// What the runtime would get for each container: the CDI devices of its claims.
	containers := map[string][]string{}
	for _, c := range append(append([]v1.Container{}, pod.Spec.InitContainers...), pod.Spec.Containers...) {
		info, err := h.dra.GetResources(pod, &c)
		if err != nil {
			return fmt.Errorf("container %s: %w", c.Name, err)
		}
		ids := []string{}
		for _, d := range info.CDIDevices {
			ids = append(ids, d.Name)
		}
		containers[c.Name] = ids
	}

	running, err := h.markRunning(ctx, pod)
	if err != nil {
		return fmt.Errorf("update pod status: %w", err)
	}
	prev.reported = true
	emit(event{Event: "prepared", Pod: key, Containers: containers, PrepareMs: prepareMs})
	return h.finishIfDone(ctx, key, running)
}

// runFor is how long the containers of pod run before they exit 0, from the annotation runForAnnotation; false
// when they run until the pod is deleted: no annotation, or containers that restart (restartPolicy Always).
func runFor(pod *v1.Pod) (time.Duration, bool, error) {
	value, ok := pod.Annotations[runForAnnotation]
	if !ok || pod.Spec.RestartPolicy == v1.RestartPolicyAlways || pod.Spec.RestartPolicy == "" {
		return 0, false, nil
	}
	d, err := time.ParseDuration(value)
	if err != nil || d < 0 {
		return 0, false, fmt.Errorf("annotation %s=%q is not a duration like 5s: %v", runForAnnotation, value, err)
	}
	return d, true, nil
}

// finishIfDone marks a running pod Succeeded once its run time (runFor) is over, and comes back for it later
// when that time is still ahead.
func (h *harness) finishIfDone(ctx context.Context, key string, pod *v1.Pod) error {
	d, ok, err := runFor(pod)
	if err != nil {
		// Retrying cannot fix the annotation; say so once and let the pod run.
		emit(event{Event: "bad-annotation", Pod: key, Error: err.Error()})
		return nil
	}
	if !ok || pod.Status.StartTime == nil {
		return nil
	}
	if left := time.Until(pod.Status.StartTime.Add(d)); left > 0 {
		h.queue.AddAfter(key, left)
		return nil
	}
	if err := h.markSucceeded(ctx, pod); err != nil {
		return fmt.Errorf("mark pod succeeded: %w", err)
	}
	emit(event{Event: "succeeded", Pod: key})
	return nil
}

// finishDeletion deletes a terminating pod whose resources are released, as the kubelet does once its
// containers stopped: grace period 0, only this very pod (UID precondition).
func (h *harness) finishDeletion(ctx context.Context, key string, pod *v1.Pod) error {
	err := h.client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{
		GracePeriodSeconds: ptr.To[int64](0),
		Preconditions:      metav1.NewUIDPreconditions(string(pod.UID)),
	})
	if err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
		return fmt.Errorf("delete terminating pod: %w", err)
	}
	emit(event{Event: "deleted", Pod: key})
	return nil
}

// unprepare calls UnprepareResources and reports it when there was something to unprepare: the pod was
// prepared, or the manager still holds claims for it.
func (h *harness) unprepare(ctx context.Context, key string, p *startedPod) error {
	held := h.dra.PodMightNeedToUnprepareResources(p.pod.UID)
	if err := h.dra.UnprepareResources(ctx, p.pod); err != nil {
		emit(event{Event: "unprepare-failed", Pod: key, Error: err.Error()})
		return err
	}
	h.mu.Lock()
	delete(h.started, key)
	h.mu.Unlock()
	if held || p.prepared {
		emit(event{Event: "unprepared", Pod: key})
	}
	return nil
}

// markRunning writes the status of a pod whose containers all started and are ready, as the kubelet's status
// manager would (without IPs or image ids). A conflict is retried by the caller's back-off.
func (h *harness) markRunning(ctx context.Context, pod *v1.Pod) (*v1.Pod, error) {
	now := metav1.Now()
	p := pod.DeepCopy()
	st := &p.Status
	st.Phase = v1.PodRunning
	if st.StartTime == nil {
		st.StartTime = &now
	}
	for _, t := range []v1.PodConditionType{v1.PodReadyToStartContainers, v1.PodInitialized, v1.ContainersReady, v1.PodReady} {
		setCondition(st, t, now)
	}
	st.ContainerStatuses = nil
	for _, c := range pod.Spec.Containers {
		st.ContainerStatuses = append(st.ContainerStatuses, v1.ContainerStatus{
			Name:    c.Name,
			Image:   c.Image,
			Ready:   true,
			Started: ptr.To(true),
			State:   v1.ContainerState{Running: &v1.ContainerStateRunning{StartedAt: now}},
		})
	}
	// The kubelet fills in the health of allocated DRA devices (feature ResourceHealthStatus) the same way.
	h.deviceHealthInto(ctx, pod, st)
	return h.client.CoreV1().Pods(p.Namespace).UpdateStatus(ctx, p, metav1.UpdateOptions{})
}

// markSucceeded writes the status of a pod whose containers all exited 0 (reason Completed).
func (h *harness) markSucceeded(ctx context.Context, pod *v1.Pod) error {
	now := metav1.Now()
	p := pod.DeepCopy()
	st := &p.Status
	st.Phase = v1.PodSucceeded
	for i := range st.Conditions {
		switch st.Conditions[i].Type {
		case v1.PodReady, v1.ContainersReady, v1.PodReadyToStartContainers:
			st.Conditions[i] = v1.PodCondition{Type: st.Conditions[i].Type, Status: v1.ConditionFalse,
				Reason: "PodCompleted", LastTransitionTime: now}
		}
	}
	for i := range st.ContainerStatuses {
		c := &st.ContainerStatuses[i]
		started := now
		if c.State.Running != nil {
			started = c.State.Running.StartedAt
		}
		c.Ready, c.Started = false, ptr.To(false)
		c.State = v1.ContainerState{Terminated: &v1.ContainerStateTerminated{
			ExitCode: 0, Reason: "Completed", StartedAt: started, FinishedAt: now}}
	}
	_, err := h.client.CoreV1().Pods(p.Namespace).UpdateStatus(ctx, p, metav1.UpdateOptions{})
	return err
}

func setCondition(st *v1.PodStatus, t v1.PodConditionType, now metav1.Time) {
	for i := range st.Conditions {
		if st.Conditions[i].Type == t {
			if st.Conditions[i].Status != v1.ConditionTrue {
				st.Conditions[i] = v1.PodCondition{Type: t, Status: v1.ConditionTrue, LastTransitionTime: now}
			}
			return
		}
	}
	st.Conditions = append(st.Conditions, v1.PodCondition{Type: t, Status: v1.ConditionTrue, LastTransitionTime: now})
}

// event is one line on stdout.
type event struct {
	Event      string              `json:"event"`
	Pod        string              `json:"pod,omitempty"`
	Containers map[string][]string `json:"containers,omitempty"`
	Driver     string              `json:"driver,omitempty"`
	Endpoint   string              `json:"endpoint,omitempty"`
	Node       string              `json:"node,omitempty"`
	Error      string              `json:"error,omitempty"`
	// PrepareMs: on "prepared", the DRA manager's PrepareResources call (the claims read from the API server, the
	// driver's NodePrepareResources, the checkpoint), as the kubelet's pod worker waits on it.
	PrepareMs float64 `json:"prepareMs,omitempty"`
}

var stdout = struct {
	sync.Mutex
	*json.Encoder
}{Encoder: json.NewEncoder(os.Stdout)}

// emit prints one event; lines from concurrent workers never interleave.
func emit(e event) {
	stdout.Lock()
	defer stdout.Unlock()
	_ = stdout.Encode(e)
}
