# layout: the layering rules of the source tree (scripts/check_layering.cmake).
add_test(NAME layout.layering
         COMMAND ${CMAKE_COMMAND} -DSOURCE_DIR=${PROJECT_SOURCE_DIR} -P
                 ${PROJECT_SOURCE_DIR}/scripts/check_layering.cmake)
