if(TARGET dp_distributed AND TARGET dp_data)
  add_executable(train_mnist ${CMAKE_CURRENT_SOURCE_DIR}/train_mnist.cpp)
  target_link_libraries(train_mnist PRIVATE dp_engine dp_distributed dp_data dp_cli
                        nlohmann_json::nlohmann_json)
endif()

if(TARGET dp_distributed AND TARGET dp_data)
  add_executable(train_text ${CMAKE_CURRENT_SOURCE_DIR}/train_text.cpp)
  target_link_libraries(train_text PRIVATE dp_engine dp_distributed dp_data dp_cli)
endif()
