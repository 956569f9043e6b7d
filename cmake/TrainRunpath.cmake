# RUNPATHs of train's binaries, set here instead of by CMake's automatic build RPATH, which had two
# defects (checked by tests/link_hygiene.cmake):
#  - it lists every link directory of LibTorch's targets, real or not: the wheel's caffe2::mkl names
#    ${MKL_ROOT}/lib/intel64, .../intel64_win and .../win-x64 with MKL_ROOT empty, so binaries
#    searched /lib/intel64 and the like;
#  - for a target that is installed (libtrain.so, bin/train), CMake rewrites the RPATH in place at
#    install time, so it ends the build-tree RPATH with a separator and pads it with more (to the
#    length of the install RPATH): empty entries, which the loader reads as the current directory.
#    A copy of libyaml-cpp.so.0.7 in the directory bin/train was started from was loaded.
# Every binary that loads libtrain.so or LibTorch gets its RUNPATH from train_set_runpath(), the
# same in the build and the install tree (BUILD_WITH_INSTALL_RPATH, so nothing is rewritten at
# install): where libtrain.so is relative to $ORIGIN, then TRAIN_RUNTIME_DIRS.

# TRAIN_RUNTIME_DIRS: the directories of the shared libraries that LibTorch's targets link by path
# (its own, and on a CUDA build the CUDA runtime and NVRTC that libtrain.so calls directly), as
# real paths; the compiler's implicit directories (found by the loader anyway), directories that do
# not exist, and CUDA's driver stubs (a stub libcuda.so would shadow the driver) are left out.
# On Debian's LibTorch 1.13 everything is in /usr/lib/x86_64-linux-gnu, so the list is empty.
function(_train_runtime_dirs out)
  set(implicit)
  foreach(d IN LISTS CMAKE_CXX_IMPLICIT_LINK_DIRECTORIES CMAKE_PLATFORM_IMPLICIT_LINK_DIRECTORIES)
    file(REAL_PATH "${d}" d)
    list(APPEND implicit "${d}")
  endforeach()
  set(files "${TORCH_LIBRARY}")
  set(queue ${TORCH_LIBRARIES})
  set(seen)
  while(queue)
    list(POP_FRONT queue item)
    if(item IN_LIST seen)
      continue()
    endif()
    list(APPEND seen "${item}")
    # LibTorch's interfaces name targets inside generator expressions:
    # -Wl,--no-as-needed,"$<TARGET_FILE:torch_cpu>", $<TARGET_PROPERTY:torch,INTERFACE_LINK_LIBRARIES>.
    string(REGEX MATCHALL "\\$<(TARGET_FILE|TARGET_LINKER_FILE|TARGET_PROPERTY|LINK_ONLY):[^,>]+"
           refs "${item}")
    if(refs)
      foreach(ref IN LISTS refs)
        string(REGEX REPLACE "^\\$<[A-Z_]+:" "" ref "${ref}")
        list(APPEND queue "${ref}")
      endforeach()
    elseif(TARGET "${item}")
      get_target_property(aliased "${item}" ALIASED_TARGET)
      if(aliased)
        list(APPEND queue "${aliased}")
        continue()
      endif()
      get_target_property(imported "${item}" IMPORTED)
      get_target_property(type "${item}" TYPE)
      if(imported AND type MATCHES "^(SHARED|UNKNOWN)_LIBRARY$")
        get_target_property(configs "${item}" IMPORTED_CONFIGURATIONS)
        foreach(suffix "" ${configs})
          if(suffix)
            string(TOUPPER "_${suffix}" suffix)
          endif()
          get_target_property(location "${item}" IMPORTED_LOCATION${suffix})
          if(location)
            list(APPEND files "${location}")
          endif()
        endforeach()
      endif()
      get_target_property(deps "${item}" INTERFACE_LINK_LIBRARIES)
      if(deps)
        list(APPEND queue ${deps})
      endif()
    elseif(IS_ABSOLUTE "${item}")
      list(APPEND files "${item}")
    endif()
  endwhile()
  set(dirs)
  foreach(f IN LISTS files)
    if(NOT f MATCHES "\\.so(\\.[0-9]+)*$")
      continue()
    endif()
    get_filename_component(d "${f}" DIRECTORY)
    file(REAL_PATH "${d}" d)
    get_filename_component(leaf "${d}" NAME)
    if(IS_DIRECTORY "${d}" AND NOT leaf STREQUAL "stubs" AND NOT d IN_LIST implicit)
      list(APPEND dirs "${d}")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES dirs)
  set(${out} "${dirs}" PARENT_SCOPE)
endfunction()
_train_runtime_dirs(TRAIN_RUNTIME_DIRS)
message(STATUS "train: runtime library directories: ${TRAIN_RUNTIME_DIRS}")

# The directory a target's file is written to, as configured (not per configuration: a
# multi-config generator adds the same subdirectory to every target's, which the relative path
# between two of them does not see); empty when it holds a generator expression.
function(_train_output_dir target kind out)
  get_target_property(dir ${target} ${kind}_OUTPUT_DIRECTORY)
  if(NOT dir)
    get_target_property(dir ${target} BINARY_DIR)
  endif()
  if(dir MATCHES "\\$<")
    set(dir "")
  endif()
  set(${out} "${dir}" PARENT_SCOPE)
endfunction()

# train_set_runpath(TARGET [INSTALL_LIBDIR_FROM_BINDIR REL])
# libtrain.so: TRAIN_RUNTIME_DIRS, then the target's BUILD_RPATH. An executable that links it:
# $ORIGIN/<libtrain.so's directory relative to the executable's> first. An installed executable passes the relative path between
# the install tree's bin and lib directories; where that differs from the build tree's (a parent
# project's own output directories, or an install libdir of lib64), one RUNPATH cannot serve both,
# and the target keeps CMake's automatic one (rewritten at install, with the defects above in the
# build tree only).
function(train_set_runpath target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "INSTALL_LIBDIR_FROM_BINDIR" "")
  get_target_property(type ${target} TYPE)
  set(runpath)
  if(type STREQUAL "EXECUTABLE")
    _train_output_dir(${target} RUNTIME exe_dir)
    _train_output_dir(train LIBRARY lib_dir)
    if(exe_dir STREQUAL "" OR lib_dir STREQUAL "")
      return()
    endif()
    file(RELATIVE_PATH rel "${exe_dir}" "${lib_dir}")
    if(DEFINED arg_INSTALL_LIBDIR_FROM_BINDIR AND NOT rel STREQUAL arg_INSTALL_LIBDIR_FROM_BINDIR)
      message(STATUS "train: ${target} finds libtrain.so in $ORIGIN/${rel} when built and in "
                     "$ORIGIN/${arg_INSTALL_LIBDIR_FROM_BINDIR} when installed: CMake's RPATH handling")
      return()
    endif()
    if(rel STREQUAL "")
      set(runpath "$ORIGIN")
    else()
      set(runpath "$ORIGIN/${rel}")
    endif()
  endif()
  list(APPEND runpath ${TRAIN_RUNTIME_DIRS})
  # Directories the user asked for (CMAKE_BUILD_RPATH; scripts/gpu-check's unpacked Debian
  # libraries) stay, in the install tree too.
  get_target_property(extra ${target} BUILD_RPATH)
  if(extra)
    list(APPEND runpath ${extra})
  endif()
  set_target_properties(${target} PROPERTIES BUILD_WITH_INSTALL_RPATH ON INSTALL_RPATH "${runpath}")
endfunction()
