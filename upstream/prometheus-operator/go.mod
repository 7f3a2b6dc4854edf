// Fetched by upstream/build.sh prometheus-operator: the Prometheus Operator's
// CRDs (ServiceMonitor, PrometheusRule), which the cluster tier installs to
// check the chart's monitoring objects against their real schemas.
module devplugin.test/upstream/prometheus-operator

go 1.26.6

require github.com/prometheus-operator/prometheus-operator v0.86.1
