"""Small dense matrices of numbers in pure Python."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["Matrix", "ShapeError"]
__version__ = "0.3.0"


class ShapeError(ValueError):
    """Matrices whose shapes do not fit the operation."""


class Matrix:
    """An immutable rows x cols matrix."""

    def __init__(self, rows: Sequence[Sequence[float]]) -> None:
        if not rows or not rows[0]:
            raise ShapeError("a matrix needs at least one row and one column")
        width = len(rows[0])
        if any(len(row) != width for row in rows):
            raise ShapeError("all rows must have the same length")
        self._rows = [list(row) for row in rows]

    @classmethod
    def identity(cls, n: int) -> Matrix:
        return cls([[1 if i == j else 0 for j in range(n)] for i in range(n)])

    @classmethod
    def zeros(cls, rows: int, cols: int) -> Matrix:
        return cls([[0] * cols for _ in range(rows)])

    @property
    def shape(self) -> tuple[int, int]:
        return len(self._rows), len(self._rows[0])

    @property
    def rows(self) -> list[list[float]]:
        return [list(row) for row in self._rows]

    def __getitem__(self, index: tuple[int, int]) -> float:
        i, j = index
        return self._rows[i][j]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Matrix):
            return NotImplemented
        return self._rows == other._rows

    def __repr__(self) -> str:
        return f"Matrix({self._rows})"

    def _check_same_shape(self, other: Matrix, op: str) -> None:
        if self.shape != other.shape:
            raise ShapeError(f"cannot {op} {self.shape} and {other.shape} matrices")

    def __add__(self, other: Matrix) -> Matrix:
        self._check_same_shape(other, "add")
        return Matrix([[a + b for a, b in zip(r, s)] for r, s in zip(self._rows, other._rows)])

    def __sub__(self, other: Matrix) -> Matrix:
        self._check_same_shape(other, "subtract")
        return Matrix([[a - b for a, b in zip(r, s)] for r, s in zip(self._rows, other._rows)])

    def scale(self, factor: float) -> Matrix:
        return Matrix([[factor * a for a in row] for row in self._rows])

    def __matmul__(self, other: Matrix) -> Matrix:
        n, m = self.shape
        m2, p = other.shape
        if m != m2:
            raise ShapeError(f"cannot multiply {self.shape} by {other.shape} matrices")
        rows = [[sum(self._rows[i][k] * other._rows[k][j] for k in range(m)) for j in range(p)] for i in range(n)]
        return Matrix(rows)

    def transpose(self) -> Matrix:
        rows, cols = self.shape
        return Matrix([[self._rows[i][j] for i in range(rows)] for j in range(cols)])

    def trace(self) -> float:
        n, m = self.shape
        if n != m:
            raise ShapeError(f"trace needs a square matrix, got {self.shape}")
        return sum(self._rows[i][i] for i in range(n))

    def determinant(self) -> float:
        """By Gaussian elimination with partial pivoting; each row swap flips the sign."""
        n, m = self.shape
        if n != m:
            raise ShapeError(f"determinant needs a square matrix, got {self.shape}")
        a = [[float(x) for x in row] for row in self._rows]
        sign = 1.0
        for col in range(n):
            pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
            if a[pivot][col] == 0:
                return 0.0
            if pivot != col:
                a[col], a[pivot] = a[pivot], a[col]
                sign = -sign
            for r in range(col + 1, n):
                factor = a[r][col] / a[col][col]
                for c in range(col, n):
                    a[r][c] -= factor * a[col][c]
        product = sign
        for i in range(n):
            product *= a[i][i]
        return product

    def __pow__(self, exponent: int) -> Matrix:
        """Repeated multiplication by squaring; the zeroth power is the identity."""
        n, m = self.shape
        if n != m:
            raise ShapeError(f"powers need a square matrix, got {self.shape}")
        if exponent < 0:
            raise ValueError("negative powers are not supported")
        result = Matrix.identity(n)
        base = self
        while exponent:
            if exponent % 2 == 1:
                result = result @ base
            base = base @ base
            exponent //= 2
        return result
