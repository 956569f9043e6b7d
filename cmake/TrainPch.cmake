# One precompiled LibTorch header (torch/torch.h) for the programs built beside the library: the
# train command, the examples, the benchmarks and the test binary. Each of the first three is a
# single translation unit that would otherwise parse LibTorch's headers on its own, which is most
# of its compile time; with one shared PCH the headers are parsed once for all of them. (The
# library has its own: it is compiled with -fPIC, and a PCH only serves the flags it was built
# with.)
#
#   train_use_shared_pch(TARGET)    a no-op without TRAIN_PCH
#
# A target whose compile flags differ from the others' (the ASan test binary) takes its own PCH.
function(train_use_shared_pch target)
  if(NOT TRAIN_PCH)
    return()
  endif()
  if(NOT TARGET train_shared_pch)
    set(_source ${PROJECT_BINARY_DIR}/train_shared_pch.cpp)
    if(NOT EXISTS ${_source})
      file(WRITE ${_source} "// Holds the precompiled header the programs share (cmake/TrainPch.cmake).\n")
    endif()
    add_library(train_shared_pch OBJECT ${_source})
    target_link_libraries(train_shared_pch PRIVATE train)
    target_precompile_headers(train_shared_pch PRIVATE <torch/torch.h>)
  endif()
  target_precompile_headers(${target} REUSE_FROM train_shared_pch)
endfunction()
