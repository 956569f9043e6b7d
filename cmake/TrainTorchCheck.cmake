# Guards against mixing two LibTorch installs (for example the torch wheel's headers with
# Debian's /usr/lib/libtorch.so), which compiles but crashes or fails to link later.
get_filename_component(_train_torch_libdir "${TORCH_LIBRARY}" DIRECTORY)
get_filename_component(_train_torch_libdir "${_train_torch_libdir}" REALPATH)
get_target_property(_train_torch_inc torch INTERFACE_INCLUDE_DIRECTORIES)
list(GET _train_torch_inc 0 _train_torch_inc0)
get_filename_component(_train_torch_root "${_train_torch_inc0}/.." REALPATH)
# A path test, not a regex: a root such as /opt/libtorch-2.3.0+cpu holds regex characters.
cmake_path(IS_PREFIX _train_torch_root "${_train_torch_libdir}" NORMALIZE _train_torch_lib_inside)
if(NOT _train_torch_root STREQUAL "/usr" AND NOT _train_torch_lib_inside)
  message(FATAL_ERROR
    "LibTorch headers come from ${_train_torch_inc0} but libtorch.so from ${TORCH_LIBRARY}.\n"
    "Point CMAKE_PREFIX_PATH at the LibTorch root (for the pip wheel: "
    "python3 -c 'import torch,os; print(os.path.dirname(torch.__file__))').")
endif()
set(TRAIN_TORCH_HAS_CUDA OFF)
if(TARGET torch_cuda OR TARGET torch_cuda_library OR TORCH_CUDA_LIBRARIES)
  set(TRAIN_TORCH_HAS_CUDA ON)
endif()
message(STATUS "train: LibTorch ${Torch_VERSION} from ${_train_torch_root} (CUDA: ${TRAIN_TORCH_HAS_CUDA})")
