# communication: dp::dist collectives walked through across worker processes it launches
# itself, and a hand-written ring all-reduce timed next to the library's.
if(TARGET dp_distributed)
  add_executable(communication ${CMAKE_CURRENT_SOURCE_DIR}/communication.cpp)
  target_link_libraries(communication PRIVATE dp_distributed dp_cli)
endif()
