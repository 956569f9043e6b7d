# Sourced by scripts/build and scripts/test (needs $here, the repository root).
# The torch wheel's LibTorch is built with CUDA 13.0, and its CMake package (find_package(Torch))
# needs a CUDA toolkit, nvcc included, even to build for the CPU. A machine that has one (nvcc on
# PATH, or in $CUDA_HOME or /usr/local/cuda) uses it; on one without, scripts/setup put NVIDIA's
# toolkit wheels from PyPI into the venv (site-packages/nvidia/cu13, beside the CUDA runtime
# wheels torch brings), and this puts that toolkit first on PATH, where CMake's FindCUDA,
# enable_language(CUDA) and FindCUDAToolkit all look.
train_venv_cuda_root() {
  "$here/.venv/bin/python" -c 'import os, sysconfig; print(os.path.join(sysconfig.get_paths()["purelib"], "nvidia", "cu13"))' 2>/dev/null
}
train_system_has_cuda() {
  command -v nvcc >/dev/null 2>&1 || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]
}
if [ "${TRAIN_CUDA_FROM_VENV:-0}" = 1 ] || ! train_system_has_cuda; then
  if [ -x "$here/.venv/bin/python" ]; then
    cu=$(train_venv_cuda_root)
    if [ -n "$cu" ] && [ -x "$cu/bin/nvcc" ]; then
      export PATH="$cu/bin:$PATH" CUDA_HOME="$cu" CUDA_PATH="$cu"
    fi
  fi
fi
