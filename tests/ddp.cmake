dp_add_test(test_ddp SOURCES test_ddp.cpp test_ddp_hook.cpp test_gpt_engines.cpp LIBS dp_distributed dp_data dp_engine)
