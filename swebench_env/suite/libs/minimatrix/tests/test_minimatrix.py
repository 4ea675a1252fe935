import pytest

from minimatrix import Matrix, ShapeError


def test_shape_and_indexing():
    a = Matrix([[1, 2, 3], [4, 5, 6]])
    assert a.shape == (2, 3)
    assert a[1, 2] == 6


def test_rejects_ragged_rows():
    with pytest.raises(ShapeError, match="same length"):
        Matrix([[1, 2], [3]])
    with pytest.raises(ShapeError, match="at least one row"):
        Matrix([])


def test_identity_and_zeros():
    assert Matrix.identity(2).rows == [[1, 0], [0, 1]]
    assert Matrix.zeros(2, 3).rows == [[0, 0, 0], [0, 0, 0]]


def test_add_and_subtract():
    a = Matrix([[1, 2], [3, 4]])
    b = Matrix([[10, 20], [30, 40]])
    assert (a + b).rows == [[11, 22], [33, 44]]
    assert (b - a).rows == [[9, 18], [27, 36]]


def test_add_checks_shapes():
    with pytest.raises(ShapeError, match="cannot add"):
        Matrix([[1, 2]]) + Matrix([[1], [2]])


def test_scale():
    assert Matrix([[1, -2]]).scale(3).rows == [[3, -6]]


def test_square_matmul():
    a = Matrix([[1, 2], [3, 4]])
    b = Matrix([[5, 6], [7, 8]])
    assert (a @ b).rows == [[19, 22], [43, 50]]
    assert a @ Matrix.identity(2) == a


def test_rectangular_matmul():
    a = Matrix([[1, 2, 3], [4, 5, 6]])
    b = Matrix([[7, 8], [9, 10], [11, 12]])
    assert (a @ b).rows == [[58, 64], [139, 154]]
    assert (b @ a).shape == (3, 3)


def test_matmul_checks_shapes():
    with pytest.raises(ShapeError, match="cannot multiply"):
        Matrix([[1, 2]]) @ Matrix([[1, 2]])


def test_transpose_square():
    assert Matrix([[1, 2], [3, 4]]).transpose().rows == [[1, 3], [2, 4]]


def test_transpose_rectangular():
    t = Matrix([[1, 2, 3], [4, 5, 6]]).transpose()
    assert t.shape == (3, 2)
    assert t.rows == [[1, 4], [2, 5], [3, 6]]


def test_trace():
    assert Matrix([[1, 2, 0], [3, 4, 0], [0, 0, 5]]).trace() == 10
    with pytest.raises(ShapeError, match="square"):
        Matrix([[1, 2]]).trace()


def test_determinant_without_pivoting():
    assert Matrix([[6, 3], [4, 3]]).determinant() == pytest.approx(6.0)
    assert Matrix([[2, 0, 0], [0, 3, 0], [0, 0, 4]]).determinant() == pytest.approx(24.0)


def test_determinant_with_row_swaps():
    assert Matrix([[1, 2], [3, 4]]).determinant() == pytest.approx(-2.0)
    assert Matrix([[0, 1], [1, 0]]).determinant() == pytest.approx(-1.0)
    assert Matrix([[2, -3, 1], [2, 0, -1], [1, 4, 5]]).determinant() == pytest.approx(49.0)


def test_determinant_of_singular_matrix():
    assert Matrix([[1, 2], [2, 4]]).determinant() == 0.0


def test_power():
    a = Matrix([[1, 2], [3, 4]])
    assert (a**1) == a
    assert (a**2).rows == [[7, 10], [15, 22]]
    assert (a**3).rows == [[37, 54], [81, 118]]


def test_power_zero_is_identity():
    assert (Matrix([[5, 1], [2, 3]]) ** 0) == Matrix.identity(2)


def test_power_of_fibonacci_matrix():
    assert (Matrix([[1, 1], [1, 0]]) ** 10)[0, 1] == 55


def test_power_rejects_negative_exponent():
    with pytest.raises(ValueError, match="negative"):
        Matrix.identity(2) ** -1
