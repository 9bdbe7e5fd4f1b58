dp_add_test(test_dp SOURCES test_dp.cpp test_dp_gpt.cpp test_engine_state.cpp test_nn_params.cpp
            test_step_stages.cpp LIBS dp_engine)
dp_add_test(test_sync_bn SOURCES test_sync_bn.cpp LIBS dp_engine)
