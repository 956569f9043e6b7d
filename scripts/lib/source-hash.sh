# Sourced by scripts/gpu-prebuild and scripts/gpu-check. source_hash prints one hash of every file
# that goes into the build (sources, headers, CMake files), by path and content, so that binaries
# built on one machine are used on another only for the very same sources. The two machines hold
# the same working tree (the GPU machine gets a copy), so the same find sees the same files.
source_hash() {
  (cd "$1" && find CMakeLists.txt cmake libtrain tests benchmarks examples fuzz -type f \
      \( -name '*.cpp' -o -name '*.h' -o -name '*.hpp' -o -name '*.inc' -o -name '*.in' -o -name '*.cmake' \
         -o -name CMakeLists.txt \) -not -path '*/__pycache__/*' 2>/dev/null |
    LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)
}
