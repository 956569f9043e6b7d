# Installs train from the current build tree into a temporary prefix, runs the installed `train`
# command, then configures, builds and runs a downstream project twice: through
# find_package(train) and through add_subdirectory. Also checks that train as a subdirectory
# leaves the parent's build type alone, and that find_package(train) refuses a project that
# found another LibTorch version first.
function(run)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "failed (${rc}): ${ARGV}\n${out}\n${err}")
  endif()
  message(STATUS "${out}")
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)
run(${CMAKE_COMMAND} --install ${TRAIN_BINARY_DIR} --prefix ${prefix})

# The version of LibTorch this train was built against, as its package config records it.
file(STRINGS ${prefix}/lib/cmake/train/trainConfig.cmake _line REGEX "^set\\(TRAIN_TORCH_VERSION ")
string(REGEX REPLACE ".*\"(.*)\".*" "\\1" train_torch_version "${_line}")
if(train_torch_version STREQUAL "")
  message(FATAL_ERROR "no TRAIN_TORCH_VERSION in ${prefix}/lib/cmake/train/trainConfig.cmake")
endif()

# The installed binaries' RUNPATHs: existing directories, no empty or relative entry (the install
# tree gets the same ones as the build tree: cmake/TrainRunpath.cmake).
file(GLOB_RECURSE installed_lib LIST_DIRECTORIES false ${prefix}/*/libtrain.so)
list(LENGTH installed_lib n)
if(NOT n EQUAL 1)
  message(FATAL_ERROR "expected one libtrain.so under ${prefix}, found: '${installed_lib}'")
endif()
set(installed_binaries ${installed_lib})
if(EXISTS ${prefix}/bin/train)
  list(APPEND installed_binaries ${prefix}/bin/train)
endif()
list(JOIN installed_binaries "|" installed_binaries)
run(${CMAKE_COMMAND} -DREADELF=${READELF} "-DRUNPATH_FILES=${installed_binaries}"
    -DEXPORTS_LIB=${installed_lib} -P ${TRAIN_SOURCE_DIR}/tests/link_hygiene.cmake)

# The installed command runs: it finds libtrain.so in ../lib and the LibTorch train was built
# with, not another libtorch.so on the system paths.
if(EXISTS ${prefix}/bin/train)
  file(WRITE ${WORK_DIR}/tiny.yaml
       "model: {name: resnet18, in_channels: 1, width: 0.125, small_input: true}\n"
       "data: {kind: synthetic, channels: 1, image_size: 16}\n"
       "trainer: {global_batch: 4, max_steps: 1, device: cpu}\n")
  run(${prefix}/bin/train --help)
  run(${prefix}/bin/train check ${WORK_DIR}/tiny.yaml)
  find_program(LDD ldd)
  if(LDD)
    execute_process(COMMAND ${LDD} ${prefix}/bin/train OUTPUT_VARIABLE ldd_out)
    string(REGEX MATCH "libtorch_cpu\\.so[.0-9]* => ([^ \t\n]+)" _ "${ldd_out}")  # Debian's: .so.1.13
    if(CMAKE_MATCH_1 STREQUAL "")
      message(FATAL_ERROR "ldd finds no libtorch_cpu.so for the installed bin/train:\n${ldd_out}")
    endif()
    get_filename_component(torch_cpu "${CMAKE_MATCH_1}" REALPATH)
    get_filename_component(torch_root "${TORCH_PREFIX}" REALPATH)
    cmake_path(IS_PREFIX torch_root "${torch_cpu}" NORMALIZE inside)
    if(NOT inside)
      message(FATAL_ERROR "installed bin/train loads libtorch_cpu.so from '${torch_cpu}', not from the "
                          "LibTorch it was built with (${torch_root}):\n${ldd_out}")
    endif()
  endif()
endif()

# package: only train's prefix is given; its package config must find the LibTorch it was built
# with by itself. subdir: the LibTorch root is given, as for any project that builds train.
foreach(mode package subdir)
  set(b ${WORK_DIR}/${mode})
  if(mode STREQUAL "package")
    set(ENV{CMAKE_PREFIX_PATH} "${prefix}")
  else()
    set(ENV{CMAKE_PREFIX_PATH} "${TORCH_PREFIX}")
  endif()
  run(${CMAKE_COMMAND} -S ${TRAIN_SOURCE_DIR}/tests/downstream/project -B ${b} -DMODE=${mode}
      -DTRAIN_SOURCE_DIR=${TRAIN_SOURCE_DIR} -DCMAKE_BUILD_TYPE=Release)
  run(${CMAKE_COMMAND} --build ${b} -j 2)
  run(${b}/downstream)
endforeach()

# A parent project without a build type: train as its subdirectory must not set one (configure
# only; the project checks it).
set(ENV{CMAKE_PREFIX_PATH} "${TORCH_PREFIX}")
run(${CMAKE_COMMAND} -S ${TRAIN_SOURCE_DIR}/tests/downstream/project -B ${WORK_DIR}/subdir-no-build-type
    -DMODE=subdir -DTRAIN_SOURCE_DIR=${TRAIN_SOURCE_DIR})

# A project that finds another LibTorch version before find_package(train) must fail to configure,
# saying why. The other LibTorch: Debian's libtorch-dev or the project venv's torch wheel,
# whichever train was not built with (skipped where only one is installed).
file(GLOB other_torch_versions
     /usr/lib/*/cmake/Torch/TorchConfigVersion.cmake /usr/share/cmake/Torch/TorchConfigVersion.cmake
     ${TRAIN_SOURCE_DIR}/.venv/lib/python3*/site-packages/torch/share/cmake/Torch/TorchConfigVersion.cmake)
set(other_torch_dir "")
foreach(f IN LISTS other_torch_versions)
  file(STRINGS ${f} _line REGEX "^set\\(PACKAGE_VERSION ")
  string(REGEX REPLACE ".*\"(.*)\".*" "\\1" v "${_line}")
  if(NOT v VERSION_EQUAL train_torch_version)
    get_filename_component(other_torch_dir ${f} DIRECTORY)
    set(other_torch_version ${v})
    break()
  endif()
endforeach()
if(other_torch_dir)
  set(ENV{CMAKE_PREFIX_PATH} "${prefix}")
  execute_process(
    COMMAND ${CMAKE_COMMAND} -S ${TRAIN_SOURCE_DIR}/tests/downstream/project -B ${WORK_DIR}/mismatch
      -DMODE=mismatch -DTorch_DIR=${other_torch_dir} -DCMAKE_BUILD_TYPE=Release
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(REGEX REPLACE "[ \n]+" " " said "${out} ${err}")  # CMake may break the message's lines
  if(rc EQUAL 0 OR NOT said MATCHES "built against LibTorch ${train_torch_version}.*uses LibTorch ${other_torch_version}")
    message(FATAL_ERROR "find_package(train) after find_package(Torch) found LibTorch ${other_torch_version} "
                        "(train has ${train_torch_version}) should fail, saying why; it gave (${rc}):\n${out}\n${err}")
  endif()
  message(STATUS "LibTorch ${other_torch_version} found first: refused as it should be")
else()
  message(STATUS "no LibTorch other than ${train_torch_version} here: the version-mismatch check is skipped")
endif()
