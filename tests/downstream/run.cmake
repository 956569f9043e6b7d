# Installs train from the current build tree into a temporary prefix, then configures, builds
# and runs a downstream project twice: through find_package(train) and through add_subdirectory.
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
