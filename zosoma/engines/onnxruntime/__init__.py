"""The ONNX Runtime engine (OnnxRuntimeOps, onnxrt_ops): an inference-only runtime fed whole
perturbed models (zosoma.engines.forward_only); the update stays on the host."""
