# fsdpp_layer(NAME FOLDER DIR SOURCES ... [DEPENDS layer ...]): the library of one layer of
# the engine, fsdpp_<NAME>, from the sources of DIR (a folder whose includes start with
# FOLDER/), linking the layers it DEPENDS on (and through them theirs) and no other. Each
# build checks every file of DIR against that order (cmake/check_layer_includes.cmake): an
# include of a layer it does not build on fails the build. Every layer shares the one
# precompiled header of fsdpp_core.
set(FSDPP_LAYER_FOLDERS core distributed models fsdp io loss data optim metrics bindings run cli)

function(fsdpp_layer name)
  cmake_parse_arguments(L "" "FOLDER;DIR" "SOURCES;DEPENDS" ${ARGN})
  set(allowed ${L_FOLDER})
  foreach(dep IN LISTS L_DEPENDS)
    get_target_property(dep_folders fsdpp_${dep} FSDPP_FOLDERS)
    list(APPEND allowed ${dep_folders})
  endforeach()
  list(REMOVE_DUPLICATES allowed)
  file(GLOB files CONFIGURE_DEPENDS ${L_DIR}/*.h ${L_DIR}/*.cpp ${L_DIR}/*.cu ${L_DIR}/*.cuh)
  set(stamp ${CMAKE_BINARY_DIR}/layers/${name}.checked)
  string(REPLACE ";" "|" allowed_arg "${allowed}")
  string(REPLACE ";" "|" known_arg "${FSDPP_LAYER_FOLDERS}")
  string(REPLACE ";" "|" files_arg "${files}")
  add_custom_command(OUTPUT ${stamp}
    COMMAND ${CMAKE_COMMAND} -DLAYER=${L_FOLDER} -DALLOWED=${allowed_arg} -DKNOWN=${known_arg}
            -DFILES=${files_arg} -DSTAMP=${stamp} -P ${PROJECT_SOURCE_DIR}/cmake/check_layer_includes.cmake
    DEPENDS ${files} ${PROJECT_SOURCE_DIR}/cmake/check_layer_includes.cmake
    COMMENT "fsdpp: layer ${name} includes only what it builds on" VERBATIM)
  add_library(fsdpp_${name} STATIC ${L_SOURCES} ${stamp})
  foreach(dep IN LISTS L_DEPENDS)
    target_link_libraries(fsdpp_${name} PUBLIC fsdpp_${dep})
  endforeach()
  set_target_properties(fsdpp_${name} PROPERTIES FSDPP_FOLDERS "${allowed}")
  if(NOT name STREQUAL "core")
    target_precompile_headers(fsdpp_${name} REUSE_FROM fsdpp_core)
  endif()
endfunction()
