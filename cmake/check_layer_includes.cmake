# Fails the build when a file of one layer of the engine includes a header of a layer it may
# not: one above it, or one beside it that it does not build on. Run by fsdpp_layer
# (engine/CMakeLists.txt) as a step of each layer's library, whenever one of its files changes.
#   LAYER    the layer's folder ("fsdp", "bindings/lua", ...)
#   ALLOWED  |-separated first folders it may include from: its own and those it builds on
#   KNOWN    |-separated first folders of every layer
#   FILES    |-separated files of the layer
#   STAMP    written once every file passes
cmake_minimum_required(VERSION 3.25)
string(REPLACE "|" ";" allowed "${ALLOWED}")
string(REPLACE "|" ";" known "${KNOWN}")
string(REPLACE "|" ";" files "${FILES}")
foreach(file IN LISTS files)
  file(STRINGS "${file}" includes REGEX "^#include \"[a-z_]+/")
  foreach(line IN LISTS includes)
    string(REGEX MATCH "^#include \"([a-z_]+)/" matched "${line}")
    set(folder "${CMAKE_MATCH_1}")
    if(folder IN_LIST known AND NOT folder IN_LIST allowed)
      string(REPLACE ";" ", " builds_on "${allowed}")
      message(FATAL_ERROR "${file}: ${line} reaches layer '${folder}', which layer '${LAYER}' does not build on "
                          "(it may include: ${builds_on})")
    endif()
  endforeach()
endforeach()
file(TOUCH "${STAMP}")
