import pytest
from cache_support import FakeClock


@pytest.fixture
def clock():
    return FakeClock()
